"""One direction of one kind of ring between two local ranks: a single-producer,
single-consumer queue of fixed-size chunks in the shared-memory segment.

Collectives and point-to-point messages use the same ring (each kind has its own rings,
so neither can block the other). The producer writes a chunk's payload and header, then
publishes it by advancing ``head``; the consumer reads the oldest chunk and frees it by
advancing ``tail``. Head and tail live on separate cache lines of the ring's control
block; each side writes only its own word, so no lock is needed (x86-64 and aarch64 keep
aligned 8-byte stores atomic, and numpy writes them whole).

A chunk's header is up to 8 int64 words whose meaning belongs to the user of the ring
(collectives: seq, message index, size, chunk index; point to point: tag, seq, offset,
length, total). A slot may carry, instead of a payload, a single-copy descriptor: the
sender's (pid, address), read by the receiver with process_vm_readv.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .shm import RING_CTL_WORDS, SLOT_HDR, Segment

HEAD, TAIL = 0, 8  # control words: chunks published, chunks consumed


class Ring:
    __slots__ = ("chunk", "ctl", "desc", "hdr", "nslots", "payload")

    def __init__(self, seg: Segment, kind: int, src: int, dst: int) -> None:
        lay = seg.layout
        pidx = lay.pair_index(src, dst)
        assert seg.ring_ctl is not None and seg.rings is not None
        assert RING_CTL_WORDS > TAIL
        # memoryviews: plain int access, several times faster than numpy scalars
        self.ctl = memoryview(seg.ring_ctl[kind, pidx])
        data = seg.rings[kind, pidx]
        self.hdr = memoryview(data[:, :SLOT_HDR].view(np.int64))
        self.payload = data[:, SLOT_HDR:]
        self.desc = memoryview(data[:, SLOT_HDR:SLOT_HDR + 16].view(np.int64))
        self.nslots = lay.ring_chunks
        self.chunk = lay.chunk_size

    # -- producer ---------------------------------------------------------------------

    def free(self) -> int:
        """Chunks the producer may write now."""
        ctl = self.ctl
        return self.nslots - (ctl[HEAD] - ctl[TAIL])

    def push(self, header: Sequence[int], payload: np.ndarray | None = None) -> int:
        """Write one chunk (the caller has checked ``free()``) and publish it at once, so
        the consumer pipelines behind the producer. Returns the new head."""
        head = self.ctl[HEAD]
        s = head % self.nslots
        if payload is not None and len(payload):
            np.copyto(self.payload[s, :len(payload)], payload)
        h = self.hdr
        for i, v in enumerate(header):
            h[s, i] = v
        self.ctl[HEAD] = head + 1
        return head + 1

    def push_desc(self, header: Sequence[int], pid: int, addr: int) -> int:
        """Publish a single-copy descriptor in place of a payload. Returns the new head:
        the sender's data may be reused once ``consumed()`` reaches it."""
        head = self.ctl[HEAD]
        s = head % self.nslots
        h = self.hdr
        for i, v in enumerate(header):
            h[s, i] = v
        self.desc[s, 0], self.desc[s, 1] = pid, addr
        self.ctl[HEAD] = head + 1
        return head + 1

    def consumed(self) -> int:
        return self.ctl[TAIL]

    # -- consumer ---------------------------------------------------------------------

    def avail(self) -> int:
        """Chunks the consumer may read now."""
        ctl = self.ctl
        return ctl[HEAD] - ctl[TAIL]

    def front(self) -> int:
        """The slot of the oldest unread chunk (the caller has checked ``avail()``)."""
        return self.ctl[TAIL] % self.nslots

    def pop(self) -> None:
        """Free the oldest chunk: the producer may overwrite it."""
        self.ctl[TAIL] = self.ctl[TAIL] + 1
