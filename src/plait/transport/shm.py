"""The shared-memory segment of one communicator on one host.

One segment per (communicator, host), created by the host's lowest rank and unlinked as
soon as every local rank has mapped it, so nothing is left in /dev/shm even if a rank is
killed afterwards. It is opened with ``os.open(..., 0o600)`` + ``mmap`` rather than
``multiprocessing.shared_memory``: Python 3.11 registers every attach with the resource
tracker, which unlinks segments peers still use (bpo-39959).

Layout (L local ranks, all offsets 4 KiB aligned)::

    control   L blocks of 64 int64 words (see the W_* indices), then one ring-control
              block of 16 words (head, tail on separate cache lines) per directed pair and
              ring kind
    slots     2 x L x slot_size: the double-buffered slots of the direct algorithms
    rings     2 kinds (collective, point-to-point) x L x (L-1) pair rings, each
              ring_chunks x (64-byte header + chunk_size)
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import PlaitError
from . import liveness
from .futex import Bell

MAGIC = 0x504C414954534D31  # "PLAITSM1"
PAGE = 4096
CTL_WORDS = 64
RING_CTL_WORDS = 16
SLOT_HDR = 64

# control words of each local rank (int64 index inside its block)
W_BELL = 0  # int32 futex word + int32 sleeping flag, woken for collective progress
W_P2P_BELL = 1  # the same for the point-to-point drainer and blocked p2p senders
W_ARRIVE = 2  # direct algorithms: last sequence number whose slot this rank filled
W_DONE = 3  # direct algorithms: last sequence number whose slots this rank has read
W_ATTACHED = 4
W_CLOSED = 5  # set when the rank closes or aborts its communicator
W_PID = 6
W_NONCE = 16  # random, written at attach: peers read it through CMA to trust our addresses
W_NONCE_ADDR = 17  # where W_NONCE lives in this rank's own address space
W_CMA_FROM = 18  # bit i set: this rank has verified it can read local rank i's memory
W_ABORT = 7  # abort notice: 1 + the lost rank, or negative (see plait.health)
W_OP_SEQ = 8  # sequence number of the collective this rank is blocked in (slow path)
W_OP_DONE = 9  # ... and of the last one it finished (diagnosis of timeouts)
W_START = 10  # this process's start time (/proc/<pid>/stat field 22): with W_PID, who it is
# 11-13: the compiled engine's (transport/csrc/engine.c): W_REDUCED (last piece whose slice
# this rank reduced), W_ADDR (its buffer's address, in-place allreduce), W_CMA_OK (which
# ranks it can read, probed once)
W_REDUCED = 11
W_ADDR = 12
W_CMA_OK = 13

KIND_COLL = 0
KIND_P2P = 1


@dataclass(frozen=True)
class Layout:
    local_size: int
    slot_size: int
    chunk_size: int
    ring_chunks: int

    @property
    def npairs(self) -> int:
        return self.local_size * max(self.local_size - 1, 0)

    @property
    def ctl_bytes(self) -> int:
        words = self.local_size * CTL_WORDS + 2 * self.npairs * RING_CTL_WORDS
        return _align(8 + words * 8)

    @property
    def slots_off(self) -> int:
        return self.ctl_bytes

    @property
    def slot_stride(self) -> int:
        return self.slot_size

    @property
    def rings_off(self) -> int:
        return _align(self.slots_off + 2 * self.local_size * self.slot_size)

    @property
    def ring_slot_stride(self) -> int:
        return SLOT_HDR + self.chunk_size

    @property
    def ring_bytes(self) -> int:
        return self.ring_chunks * self.ring_slot_stride

    @property
    def total(self) -> int:
        return _align(self.rings_off + 2 * self.npairs * self.ring_bytes)

    def pair_index(self, src: int, dst: int) -> int:
        """Index of the directed pair src -> dst (local ranks, src != dst)."""
        return src * (self.local_size - 1) + (dst if dst < src else dst - 1)


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class Segment:
    """A mapped segment; ``me`` is this rank's local index."""

    def __init__(self, mm: mmap.mmap, layout: Layout, me: int) -> None:
        self.mm = mm
        self.layout = layout
        self.me = me
        L = layout.local_size
        self.words = np.frombuffer(mm, dtype=np.int64, count=layout.ctl_bytes // 8 - 1, offset=8)
        self.ctl = self.words[: L * CTL_WORDS].reshape(L, CTL_WORDS)
        ring_ctl = self.words[L * CTL_WORDS: L * CTL_WORDS + 2 * layout.npairs * RING_CTL_WORDS]
        self.ring_ctl = ring_ctl.reshape(2, max(layout.npairs, 1) if layout.npairs else 0,
                                         RING_CTL_WORDS) if layout.npairs else None
        words32 = self.words[: L * CTL_WORDS].view(np.int32).reshape(L, CTL_WORDS * 2)
        self.bells = [Bell(words32[i, 2 * W_BELL: 2 * W_BELL + 2]) for i in range(L)]
        self.p2p_bells = [Bell(words32[i, 2 * W_P2P_BELL: 2 * W_P2P_BELL + 2]) for i in range(L)]
        self.slots = np.frombuffer(mm, dtype=np.uint8, count=2 * L * layout.slot_size,
                                   offset=layout.slots_off).reshape(2, L, layout.slot_size)
        nrings = 2 * layout.npairs
        if nrings:
            self.rings = np.frombuffer(
                mm, dtype=np.uint8, count=nrings * layout.ring_bytes, offset=layout.rings_off
            ).reshape(2, layout.npairs, layout.ring_chunks, layout.ring_slot_stride)
        else:
            self.rings = None

    def close(self) -> bool:
        """Unmap; False while a view is still alive elsewhere (try again after gc)."""
        # Drop our numpy views first: mmap.close() refuses while buffers are exported.
        self.words = self.ctl = self.ring_ctl = self.slots = self.rings = None  # type: ignore[assignment]
        self.bells = self.p2p_bells = []
        try:
            self.mm.close()
        except BufferError:
            return False
        return True


def shm_path(name: str) -> str:
    return "/dev/shm/" + name


def create(name: str, layout: Layout, me: int) -> Segment:
    """Create, size and map a new segment with owner-only permissions."""
    # Built under a temporary name and renamed into place, so a peer that opens the final
    # name always finds it sized and stamped.
    path = shm_path(name)
    tmp = path + ".init"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, layout.total)
        mm = mmap.mmap(fd, layout.total)
        np.frombuffer(mm, dtype=np.int64, count=1)[0] = MAGIC
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        unlink(name + ".init")
        raise
    os.close(fd)
    seg = Segment(mm, layout, me)
    _stamp(seg, me)
    return seg


def _stamp(seg: Segment, me: int) -> None:
    row = seg.ctl[me]
    row[W_PID] = os.getpid()
    row[W_START] = liveness.start_time_of(os.getpid()) or 0
    row[W_NONCE] = int.from_bytes(os.urandom(7), "little") | 1
    row[W_NONCE_ADDR] = row[W_NONCE:].ctypes.data
    row[W_ATTACHED] = 1


def attach(name: str, layout: Layout, me: int, deadline: float) -> Segment:
    """Map a segment created by a peer (it exists once the creator has published it)."""
    path = shm_path(name)
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise PlaitError(f"shared-memory segment {path} did not appear") from None
            time.sleep(0.001)
    try:
        size = os.fstat(fd).st_size
        if size != layout.total:
            raise PlaitError(f"shared-memory segment {path} has {size} bytes, expected "
                             f"{layout.total}: ranks disagree on PLAIT_SHM_* settings")
        mm = mmap.mmap(fd, layout.total)
    finally:
        os.close(fd)
    if np.frombuffer(mm, dtype=np.int64, count=1)[0] != MAGIC:
        mm.close()
        raise PlaitError(f"shared-memory segment {path} is not a plait segment")
    seg = Segment(mm, layout, me)
    _stamp(seg, me)
    return seg


def unlink(name: str) -> None:
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


