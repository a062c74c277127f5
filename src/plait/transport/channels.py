"""Ordered collective channels to one peer: requests the executor progresses.

Collectives run the same deterministic schedules on every rank, so between two ranks the
messages of collectives are received in exactly the order they are sent. A channel needs
no tag matching, only a check: every chunk carries (op sequence number, message index,
size), and a receiver that sees something else raises MismatchError — ranks called
different collectives.

A request's ``progress()`` moves what it can without blocking and says whether it moved
anything; ``done`` says whether it has finished.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import numpy as np

from ..errors import MismatchError, PeerFailedError
from ..reduce import Reducer
from . import cma, wire
from .futex import Bell
from .shm import RING_CTL_WORDS, SLOT_HDR, Segment
from .tcp import Outbound, recv_exact_into


class Req:
    __slots__ = ("done", "peer")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.done = False

    def progress(self) -> bool:
        raise NotImplementedError


# -- shared memory ------------------------------------------------------------------------


class ShmRing:
    """One direction (src -> dst) of one kind of ring between two local ranks."""

    def __init__(self, seg: Segment, kind: int, src: int, dst: int) -> None:
        lay = seg.layout
        pidx = lay.pair_index(src, dst)
        assert seg.ring_ctl is not None and seg.rings is not None
        # [0] head (chunks written), [8] tail (chunks read); memoryviews for fast int access
        self.ctl = memoryview(seg.ring_ctl[kind, pidx])
        data = seg.rings[kind, pidx]
        self.hdr = memoryview(data[:, :SLOT_HDR].view(np.int64))  # per slot: seq, idx, n, chunk
        self.payload = data[:, SLOT_HDR:]
        # a single-copy descriptor in place of payload: (pid, address) of the sender's data
        self.desc = memoryview(data[:, SLOT_HDR:SLOT_HDR + 16].view(np.int64))
        self.nslots = lay.ring_chunks
        self.chunk = lay.chunk_size
        assert RING_CTL_WORDS >= 16


CMA_MARK = -1  # chunk index of a slot that carries a single-copy descriptor
CMA_PIECE = 1 << 20  # bytes read per process_vm_readv when reducing (stays in cache)


class ShmSend(Req):
    __slots__ = ("bell", "cma", "cma_end", "i", "idx", "n", "nchunks", "ring", "seq", "src")

    def __init__(self, peer: int, ring: ShmRing, src: np.ndarray, seq: int, idx: int,
                 bell: Bell, cma: bool = False) -> None:
        super().__init__(peer)
        self.ring, self.src, self.seq, self.idx, self.bell = ring, src, seq, idx, bell
        self.n = len(src)
        self.nchunks = max(1, -(-self.n // ring.chunk))
        self.i = 0
        self.cma = cma
        self.cma_end = -1

    def _progress_cma(self) -> bool:
        """Post one descriptor; done once the receiver has read our buffer (tail passes)."""
        r = self.ring
        ctl = r.ctl
        if self.cma_end >= 0:
            if ctl[8] >= self.cma_end:
                self.done = True
                return True
            return False
        head = ctl[0]
        if head - ctl[8] >= r.nslots:
            return False
        s = head % r.nslots
        h = r.hdr
        h[s, 0], h[s, 1], h[s, 2], h[s, 3] = self.seq, self.idx, self.n, CMA_MARK
        r.desc[s, 0], r.desc[s, 1] = os.getpid(), self.src.ctypes.data
        self.cma_end = head + 1
        ctl[0] = head + 1
        self.bell.ring()
        return True

    def progress(self) -> bool:
        if self.cma:
            return self._progress_cma()
        r = self.ring
        ctl = r.ctl
        head = int(ctl[0])
        free = r.nslots - (head - int(ctl[8]))
        if free <= 0:
            return False
        c = r.chunk
        while free > 0 and self.i < self.nchunks:
            s = head % r.nslots
            off = self.i * c
            m = min(c, self.n - off)
            if m > 0:
                np.copyto(r.payload[s, :m], self.src[off:off + m])
            h = r.hdr
            h[s, 0], h[s, 1], h[s, 2], h[s, 3] = self.seq, self.idx, self.n, self.i
            head += 1
            self.i += 1
            free -= 1
            ctl[0] = head  # publish each chunk at once: the receiver pipelines behind us
        self.bell.ring()
        if self.i >= self.nchunks:
            self.done = True
        return True


class ShmRecv(Req):
    __slots__ = ("bell", "dst", "i", "idx", "itemsize", "n", "nchunks", "reducer", "ring",
                 "seq", "storage", "typed", "where")

    def __init__(self, peer: int, ring: ShmRing, dst: np.ndarray, reducer: Reducer | None,
                 seq: int, idx: int, bell: Bell, where: str) -> None:
        super().__init__(peer)
        self.ring, self.seq, self.idx, self.bell, self.where = ring, seq, idx, bell, where
        self.typed = dst
        self.storage = dst.dtype
        self.itemsize = dst.dtype.itemsize
        self.dst = dst.view(np.uint8)
        self.reducer = reducer
        self.n = len(self.dst)
        self.nchunks = max(1, -(-self.n // ring.chunk))
        self.i = 0

    def progress(self) -> bool:
        r = self.ring
        ctl = r.ctl
        tail = int(ctl[8])
        avail = int(ctl[0]) - tail
        if avail <= 0:
            return False
        c = r.chunk
        while avail > 0 and self.i < self.nchunks:
            s = tail % r.nslots
            h = r.hdr
            if h[s, 3] == CMA_MARK and self.i == 0 and h[s, 0] == self.seq \
                    and h[s, 1] == self.idx and h[s, 2] == self.n:
                self._read_cma(r.desc[s, 0], r.desc[s, 1])
                self.i = self.nchunks
                ctl[8] = tail + 1
                break
            if h[s, 0] != self.seq or h[s, 1] != self.idx or h[s, 2] != self.n \
                    or h[s, 3] != self.i:
                raise MismatchError(
                    f"{self.where}: from rank {self.peer} expected message {self.idx} of "
                    f"{self.n} bytes of collective #{self.seq}, got message {h[s, 1]} of "
                    f"{h[s, 2]} bytes of collective #{h[s, 0]}: the ranks called "
                    f"different collectives or passed different sizes")
            off = self.i * c
            m = min(c, self.n - off)
            if m > 0:
                if self.reducer is None:
                    np.copyto(self.dst[off:off + m], r.payload[s, :m])
                else:
                    e0, e1 = off // self.itemsize, (off + m) // self.itemsize
                    self.reducer(self.typed[e0:e1], r.payload[s, :m].view(self.storage))
            tail += 1
            self.i += 1
            avail -= 1
            ctl[8] = tail
        self.bell.ring()
        if self.i >= self.nchunks:
            self.done = True
        return True

    def _read_cma(self, pid: int, addr: int) -> None:
        if self.reducer is None:
            cma.read(pid, addr, self.dst.ctypes.data, self.n)
            return
        piece = min(self.n, CMA_PIECE)
        scratch = np.empty(piece, dtype=np.uint8)
        typed = scratch.view(self.storage)
        for off in range(0, self.n, piece):
            m = min(piece, self.n - off)
            cma.read(pid, addr + off, scratch.ctypes.data, m)
            e0 = off // self.itemsize
            k = m // self.itemsize
            self.reducer(self.typed[e0:e0 + k], typed[:k])


# -- TCP ----------------------------------------------------------------------------------


class TcpSend(Req):
    """Sends one frame per ``progress()``: a blocking send, which always completes because
    the peer's reader thread drains its socket whatever its application thread does."""

    __slots__ = ("first", "idx", "off", "out", "seq", "src")

    def __init__(self, peer: int, out: Outbound, src: np.ndarray, seq: int, idx: int) -> None:
        super().__init__(peer)
        self.out, self.src, self.seq, self.idx = out, src, seq, idx
        self.off = 0
        self.first = True

    def progress(self) -> bool:
        if self.done:
            return False
        n = len(self.src)
        m = min(self.out.max_frame, n - self.off)
        self.out.send_frame(wire.KIND_COLL, self.idx, self.seq, self.off,
                            self.src[self.off:self.off + m], n)
        self.off += m
        if self.off >= n:
            self.done = True
        return True


class TcpRecv(Req):
    __slots__ = ("dst", "error", "got", "inbox", "itemsize", "key", "n", "reducer",
                 "storage", "typed", "where")

    def __init__(self, peer: int, inbox: CollInbox, dst: np.ndarray, reducer: Reducer | None,
                 seq: int, idx: int, where: str) -> None:
        super().__init__(peer)
        self.inbox = inbox
        self.typed = dst
        self.storage = dst.dtype
        self.itemsize = dst.dtype.itemsize
        self.dst = dst.view(np.uint8)
        self.n = len(self.dst)
        self.reducer = reducer
        self.key = (seq, idx)
        self.where = where
        self.got = -1  # bytes received; -1 until the first frame (messages may be empty)
        self.error: BaseException | None = None
        inbox.post(self)

    def check(self, f: wire.Frame) -> None:
        if f.total != self.n:
            self.error = MismatchError(
                f"{self.where}: from rank {self.peer} expected {self.n} bytes for message "
                f"{self.key[1]} of collective #{self.key[0]}, got {f.total}: the ranks passed "
                f"different sizes")

    def apply(self, f: wire.Frame, payload: np.ndarray) -> None:
        if self.error is not None or f.length == 0:
            return
        if self.reducer is None:
            np.copyto(self.dst[f.offset:f.offset + f.length], payload)
        else:
            e0 = f.offset // self.itemsize
            cnt = f.length // self.itemsize
            self.reducer(self.typed[e0:e0 + cnt], payload.view(self.storage))

    def progress(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.got >= self.n:
            self.done = True
            return True
        failed = self.inbox.failed
        if failed is not None:
            self.inbox.drain_pending(self)
            if self.got < self.n:
                raise failed
        return False


class CollInbox:
    """Collective frames arriving from one peer over TCP, matched by (seq, message)."""

    def __init__(self, peer: int, bell: Bell) -> None:
        self.peer = peer
        self.bell = bell
        self.lock = threading.Lock()
        self.posted: dict[tuple[int, int], TcpRecv] = {}
        self.unexpected: dict[tuple[int, int], list[tuple[wire.Frame, np.ndarray]]] = {}
        self.failed: BaseException | None = None
        # per reader thread: with several sockets per peer, readers deliver concurrently
        self._scratch = threading.local()

    def post(self, req: TcpRecv) -> None:
        with self.lock:
            pending = self.unexpected.pop(req.key, None)
            self.posted[req.key] = req
            if pending:
                for f, payload in pending:
                    self._deliver_locked(req, f, payload)

    def drain_pending(self, req: TcpRecv) -> None:
        with self.lock:
            for f, payload in self.unexpected.pop(req.key, []):
                self._deliver_locked(req, f, payload)

    def _deliver_locked(self, req: TcpRecv, f: wire.Frame, payload: np.ndarray) -> None:
        req.check(f)
        req.apply(f, payload)
        self._count_locked(req, f)

    def _count_locked(self, req: TcpRecv, f: wire.Frame) -> None:
        req.got = max(req.got, 0) + f.length
        if req.got >= req.n or req.error is not None:
            req.got = max(req.got, req.n) if req.error is None else req.got
            self.posted.pop(req.key, None)

    def deliver(self, f: wire.Frame, sock: socket.socket) -> None:
        """Called by the reader thread with the payload still in the socket."""
        key = (f.seq, f.tag)
        with self.lock:
            req = self.posted.get(key)
        if req is not None:
            req.check(f)
            if req.error is None and req.reducer is None and f.length:
                recv_exact_into(sock, memoryview(req.dst[f.offset:f.offset + f.length]))
            elif f.length:
                buf = self._scratch_for(f.length)
                recv_exact_into(sock, memoryview(buf))
                req.apply(f, buf)
            with self.lock:
                self._count_locked(req, f)
        else:
            payload = np.empty(f.length, dtype=np.uint8)
            if f.length:
                recv_exact_into(sock, memoryview(payload))
            with self.lock:
                req = self.posted.get(key)
                if req is not None:
                    self._deliver_locked(req, f, payload)
                else:
                    self.unexpected.setdefault(key, []).append((f, payload))
        self.bell.ring()

    def _scratch_for(self, n: int) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = np.empty(n, dtype=np.uint8)
        return buf[:n]

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            self.failed = exc
        self.bell.ring()


def peer_lost_error(rank: int, peer: int, cause: Any) -> PeerFailedError:
    how = "closed its communicator" if cause is None else f"was lost ({cause})"
    return PeerFailedError(f"rank {rank}: connection from rank {peer} {how}", peer)
