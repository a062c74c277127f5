"""The shared-memory transport: the ranks of one host, through one segment per
(communicator, host) (transport/shm.py has the segment's layout and life cycle).

Collective messages go through per-pair rings (transport/ring.py) chunk by chunk; a large
message to a peer whose memory this rank may read (``process_vm_readv``, trusted once the
peer's nonce has been read through it) travels as a descriptor and is read in place: one
copy instead of two. Point-to-point messages use rings of their own, emptied by one
drainer thread per communicator (started at the first point-to-point call).

Liveness: a watch on every local peer's process, opened when it has attached (pidfd, so
a zombie or a reused PID cannot pass for the peer; plait.transport.liveness). Notices and
progress words live in each rank's control block (``W_ABORT``, ``W_OP_SEQ``,
``W_OP_DONE``, ``W_CLOSED``): see plait.health.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CommTimeoutError, MismatchError, PeerFailedError, PlaitError, timed_out
from ..reduce import Reducer
from . import cma, liveness, shm, wire
from .base import CALLER, OpCtx, PeerState, Request, Site, WaitFor
from .engine import EngineHost, WaitPolicy
from .futex import Bell, private_bell
from .ring import Ring

CMA_MARK = -1  # chunk index of a slot that carries a single-copy descriptor
CMA_PIECE = 1 << 20  # bytes read per process_vm_readv when reducing (stays in cache)


# -- collective requests -------------------------------------------------------------------


class ShmSend(Request):
    __slots__ = ("bell", "cma", "cma_end", "i", "idx", "n", "nchunks", "ring", "seq", "src")
    is_send = True
    driven_by = CALLER

    def __init__(self, peer: int, ring: Ring, src: np.ndarray, seq: int, idx: int,
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
        if self.cma_end >= 0:
            if r.consumed() >= self.cma_end:
                self.done = True
                return True
            return False
        if r.free() <= 0:
            return False
        self.cma_end = r.push_desc((self.seq, self.idx, self.n, CMA_MARK), os.getpid(),
                                   self.src.ctypes.data)
        self.bell.ring()
        return True

    def progress(self) -> bool:
        if self.cma:
            return self._progress_cma()
        r = self.ring
        free = r.free()
        if free <= 0:
            return False
        c = r.chunk
        while free > 0 and self.i < self.nchunks:
            off = self.i * c
            r.push((self.seq, self.idx, self.n, self.i), self.src[off:off + c])
            self.i += 1
            free -= 1
        self.bell.ring()
        if self.i >= self.nchunks:
            self.done = True
        return True


class ShmRecv(Request):
    __slots__ = ("bell", "dst", "i", "idx", "itemsize", "n", "nchunks", "reducer", "ring",
                 "seq", "storage", "typed", "where")
    driven_by = CALLER

    def __init__(self, peer: int, ring: Ring, dst: np.ndarray, reducer: Reducer | None,
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
        avail = r.avail()
        if avail <= 0:
            return False
        c = r.chunk
        h = r.hdr
        while avail > 0 and self.i < self.nchunks:
            s = r.front()
            if h[s, 3] == CMA_MARK and self.i == 0 and h[s, 0] == self.seq \
                    and h[s, 1] == self.idx and h[s, 2] == self.n:
                self._read_cma(r.desc[s, 0], r.desc[s, 1])
                self.i = self.nchunks
                r.pop()
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
            self.i += 1
            avail -= 1
            r.pop()
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


class ShmChannel:
    """Collective messages to and from one local peer."""

    def __init__(self, seg: shm.Segment, me: int, peer_local: int, peer: int,
                 cma_min: int) -> None:
        self.peer = peer
        self.me = me
        self.peer_local = peer_local
        self.ctl = seg.ctl
        self.out_ring = Ring(seg, shm.KIND_COLL, me, peer_local)
        self.in_ring = Ring(seg, shm.KIND_COLL, peer_local, me)
        self.peer_bell = seg.bells[peer_local]
        self.cma_min = cma_min if cma.AVAILABLE and seg.layout.local_size <= 63 else 0
        self.cma_checked = not self.cma_min

    def _verify_cma(self) -> None:
        """Trust the peer's addresses once we have read its nonce through them."""
        row = self.ctl[self.peer_local]
        pid, addr, nonce = int(row[shm.W_PID]), int(row[shm.W_NONCE_ADDR]), int(
            row[shm.W_NONCE])
        if not (pid and addr and nonce):
            return  # the peer has not attached yet: try again next time
        self.cma_checked = True
        if cma.read_word(pid, addr) == nonce:
            mine = self.ctl[self.me]
            mine[shm.W_CMA_FROM] = int(mine[shm.W_CMA_FROM]) | (1 << self.peer_local)

    def single_copy_from_peer(self) -> bool:
        """Whether this rank reads the peer's large messages in place."""
        return bool((int(self.ctl[self.me, shm.W_CMA_FROM]) >> self.peer_local) & 1)

    def send(self, view: np.ndarray, ctx: OpCtx, idx: int) -> ShmSend:
        use_cma = bool(self.cma_min) and len(view) >= self.cma_min and bool(
            (int(self.ctl[self.peer_local, shm.W_CMA_FROM]) >> self.me) & 1)
        return ShmSend(self.peer, self.out_ring, view, ctx.seq, idx, self.peer_bell, use_cma)

    def recv(self, view: np.ndarray, reducer: Reducer | None, ctx: OpCtx,
             idx: int) -> ShmRecv:
        if not self.cma_checked:
            self._verify_cma()
        return ShmRecv(self.peer, self.in_ring, view, reducer, ctx.seq, idx, self.peer_bell,
                       ctx.where)


# -- point to point -------------------------------------------------------------------------


class ShmSender:
    """Writes point-to-point messages into the ring to one local peer."""

    def __init__(self, seg: shm.Segment, me: int, peer_local: int, peer_bell: Bell) -> None:
        self.ring = Ring(seg, shm.KIND_P2P, me, peer_local)
        self.peer_bell = peer_bell
        self.lock = threading.Lock()
        self.seq = 0

    def send(self, tag: int, data: np.ndarray, wait_for: WaitFor, who: str) -> None:
        r = self.ring
        with self.lock:
            seq = self.seq
            self.seq += 1
            total = len(data)
            nchunks = max(1, -(-total // r.chunk))

            def has_space() -> bool:
                return r.free() > 0

            for i in range(nchunks):
                if not has_space():
                    wait_for(has_space, who)
                off = i * r.chunk
                m = min(r.chunk, total - off)
                r.push((tag, seq, off, m, total), data[off:off + m])
                self.peer_bell.ring()


class Drainer:
    """The thread that empties this rank's incoming point-to-point rings."""

    CHECK_S = 0.25
    """How often an idle drainer asks whether a peer died or closed: a rank blocked only
    in a receive learns of it without any collective running."""

    def __init__(self, sink: Any, rings: list[tuple[int, Ring, Bell]], bell: Bell,
                 spin_s: float, rank: int, check: Callable[[], None]) -> None:
        self.sink = sink
        self.check = check
        self.rings = rings  # (peer rank, ring peer -> me, the peer's p2p bell)
        self.bell = bell
        self.spin_s = spin_s
        self.rank = rank
        self.stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"plait-p2p-r{rank}",
                                       daemon=True)
        self.thread.start()

    def _pending(self) -> bool:
        return any(r.avail() for _, r, _ in self.rings)

    def _drain(self) -> bool:
        moved = False
        for peer, r, peer_bell in self.rings:
            h = r.hdr
            while r.avail():
                s = r.front()
                tag, seq, off, m, total = h[s, 0], h[s, 1], h[s, 2], h[s, 3], h[s, 4]
                f = wire.Frame(wire.KIND_P2P, tag, seq, off, m, total)
                payload = r.payload[s, :m]

                def read(dst: np.ndarray, _p: Any = payload) -> None:
                    np.copyto(dst, _p)

                self.sink.on_frame(peer, f, read)
                r.pop()
                peer_bell.ring()
                moved = True
        return moved

    def _run(self) -> None:
        try:
            spin_until = 0.0
            next_check = time.monotonic() + self.CHECK_S
            while not self.stop:
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.CHECK_S
                    self._drain()  # what a peer sent before it closed arrives first
                    self.check()
                if self._drain():
                    spin_until = time.monotonic() + self.spin_s
                    continue
                if time.monotonic() < spin_until:
                    os.sched_yield()
                    continue
                seen = self.bell.snapshot()
                try:
                    if not self._pending() and not self.stop:
                        self.bell.sleep(seen, 0.05)
                finally:
                    self.bell.awake()
        except BaseException as exc:
            self.error = exc
            self.sink.fail_all(PeerFailedError(f"rank {self.rank}: point-to-point "
                                               f"receiver failed: {exc!r}"))

    def close(self) -> None:
        self.stop = True
        self.bell.ring()  # changes the word, so a sleep about to start returns at once
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


# -- the transport --------------------------------------------------------------------------


def _make_segment(site: Site, local: list[int], me_local: int) -> shm.Segment:
    """Create (lowest local rank) or attach this host's segment; the creator unlinks it
    once every local rank has attached, so nothing is left in /dev/shm after a SIGKILL."""
    cfg = site.cfg
    host_index = sorted(set(site.hosts)).index(site.hosts[site.rank])
    layout = shm.Layout(len(local), cfg.shm_slot_size, cfg.shm_chunk_size,
                        cfg.shm_ring_chunks)
    name = f"plait-{site.uid.hex()[:20]}-{host_index}-{os.getuid()}"
    fail_key = f"shmfail/{host_index}"
    meet = site.meet
    if me_local != 0:
        try:
            return shm.attach(name, layout, me_local, site.deadline)
        except PlaitError as exc:
            # tell the creator at once, so it unlinks instead of waiting for us
            meet.set(fail_key, f"rank {site.rank}: {exc}")
            raise
    seg = shm.create(name, layout, 0)
    try:
        polls = 0
        while not seg.ctl[:, shm.W_ATTACHED].all():
            polls += 1
            if polls % 50 == 0 and meet.check(fail_key):
                raise PlaitError(f"rank {site.rank}, init: a local rank could not attach "
                                 f"to shared memory: {meet.get(fail_key, 1.0).decode()}")
            if time.monotonic() > site.deadline:
                att = seg.ctl[:, shm.W_ATTACHED]
                missing = [r for i, r in enumerate(local) if not att[i]]
                raise CommTimeoutError(f"rank {site.rank}, init: {timed_out(site.timeout)} "
                                       f"for local ranks {missing} to attach to shared "
                                       "memory")
            time.sleep(0.0002)
    except BaseException:
        shm.unlink(name)
        seg.close()
        raise
    shm.unlink(name)
    return seg


class ShmTransport:
    """The ranks of this host that share its memory (two or more)."""

    name = "shm"

    def __init__(self, site: Site) -> None:
        self.rank = site.rank
        self.local = list(site.local_ranks)
        self.index = {r: i for i, r in enumerate(self.local)}
        self.me = self.index[site.rank]
        self.cma_min = site.cfg.cma_min_size
        self.spin_s = site.spin_s
        self.sink = site.sink
        self.lost = site.lost
        self.explain_loss = site.explain_loss
        self.seg: shm.Segment | None = _make_segment(site, self.local, self.me)
        self.bell = self.seg.bells[self.me]
        self.p2p_bell = self.seg.p2p_bells[self.me]
        self._my_ctl: memoryview | None = memoryview(self.seg.ctl[self.me])
        self._chans: dict[int, ShmChannel] = {}
        self._senders: dict[int, ShmSender] = {}
        self._lock = threading.Lock()
        self._drainer: Drainer | None = None
        self._host: EngineHost | None = None
        # every local peer has attached (the creator waited for it; attachers find the
        # creator's stamp): watch the very processes whose pid and start time they wrote
        self._watch = liveness.PeerWatch()
        self._watch_lock = threading.Lock()
        ctl = self.seg.ctl
        for i, r in enumerate(self.local):
            if i != self.me and ctl[i, shm.W_PID]:
                self._watch.add(r, int(ctl[i, shm.W_PID]),
                                start_time=int(ctl[i, shm.W_START]) or None)

    # -- reaching peers -------------------------------------------------------------------

    def can_connect(self, peer: int) -> bool:
        return peer in self.index

    def segment(self) -> shm.Segment:
        if self.seg is None:
            raise PlaitError(f"rank {self.rank}: the shared-memory segment is closed")
        return self.seg

    def channel(self, peer: int) -> ShmChannel:
        ch = self._chans.get(peer)
        if ch is None:
            ch = self._chans.setdefault(peer, ShmChannel(self.segment(), self.me,
                                                         self.index[peer], peer, self.cma_min))
        return ch

    def single_copy_peers(self) -> list[int]:
        """Local peers whose large messages this rank reads in place."""
        seg = self.segment()
        bits = int(seg.ctl[self.me, shm.W_CMA_FROM])
        return [r for r, i in self.index.items() if (bits >> i) & 1]

    # -- point to point -------------------------------------------------------------------

    def start_p2p(self) -> None:
        if self._drainer is not None or self.seg is None:
            return
        with self._lock:
            if self._drainer is not None:
                return
            seg = self.seg
            rings = [(r, Ring(seg, shm.KIND_P2P, i, self.me), seg.p2p_bells[i])
                     for r, i in self.index.items() if r != self.rank]
            self._drainer = Drainer(self.sink, rings, self.p2p_bell, self.spin_s, self.rank,
                                    self._check_peers)

    def send_p2p(self, peer: int, tag: int, data: np.ndarray, deadline: float,
                 wait_for: WaitFor) -> None:
        sender = self._senders.get(peer)
        if sender is None:
            seg = self.segment()
            pl = self.index[peer]
            with self._lock:
                sender = self._senders.setdefault(peer, ShmSender(seg, self.me, pl,
                                                                  seg.p2p_bells[pl]))
        sender.send(tag, data, wait_for, f"rank {peer} to receive")

    # -- liveness, notices, progress words ----------------------------------------------

    def _check_peers(self) -> None:
        """Called by the drainer: fail point-to-point receives from a local peer that died
        or closed (its ring has been drained: everything it sent has been delivered)."""
        seg = self.seg
        if seg is None:
            return
        gone = [(r, f"rank {self.rank}: rank {r} ({who}) died without closing its "
                    "communicator") for r, who in self.dead_peers()]
        ctl = seg.ctl
        for r, i in self.index.items():
            if r != self.rank and ctl[i, shm.W_CLOSED]:
                gone.append((r, f"rank {self.rank}: rank {r} closed its communicator"))
        for r, why in gone:
            if r not in self.lost:
                exc = self.explain_loss(r, PeerFailedError(why, r))
                self.lost[r] = exc
                self.sink.peer_failed(r, exc)

    def dead_peers(self) -> list[tuple[int, str]]:
        seg = self.seg
        if seg is None or not self._watch_lock.acquire(blocking=False):
            return []  # closing, or another thread is checking right now
        try:
            dead = self._watch.dead()
            pids = self._watch.pids()
        finally:
            self._watch_lock.release()
        ctl = seg.ctl
        # a peer that closed its communicator and then exited is not a failure
        return [(r, f"pid {pids[r]}") for r in dead if not ctl[self.index[r], shm.W_CLOSED]]

    def notices(self) -> list[tuple[int, int]]:
        seg = self.seg
        if seg is None:
            return []
        col = seg.ctl[:, shm.W_ABORT]
        if not col.any():
            return []
        return [(self.local[i], int(v)) for i, v in enumerate(col.tolist())
                if v and i != self.me]

    def publish_notice(self, value: int) -> None:
        seg = self.seg
        if seg is None:
            return
        try:
            seg.ctl[self.me, shm.W_ABORT] = value
            for b in list(seg.bells) + list(seg.p2p_bells):
                b.ring()
        except (TypeError, ValueError, IndexError):  # segment being torn down
            pass

    def peer_states(self) -> dict[int, PeerState]:
        seg = self.seg
        if seg is None:
            return {}
        ctl = seg.ctl
        return {r: PeerState(bool(ctl[i, shm.W_CLOSED]), int(ctl[i, shm.W_OP_SEQ]),
                             int(ctl[i, shm.W_OP_DONE]))
                for r, i in self.index.items() if r != self.rank}

    publishes_progress = True

    def mark_done(self, seq: int) -> None:
        mine = self._my_ctl
        if mine is not None:
            mine[shm.W_OP_DONE] = seq

    def host_collective(self, policy: WaitPolicy) -> EngineHost | None:
        if len(self.local) < 2:
            return None
        if self._host is None:
            seg = self.segment()
            lay = seg.layout
            # the control words start after the segment's 8-byte magic header
            self._host = EngineHost(seg.mm, lay.local_size, seg.me, 8, lay.slots_off,
                                    lay.slot_size, policy, single_copy=self.cma_min > 0)
        return self._host

    def describe(self) -> dict[str, Any]:
        return {"single_copy_from": self.single_copy_peers() if self.seg is not None else []}

    def mark(self, *, blocked: int | None = None, done: int | None = None) -> None:
        mine = self._my_ctl
        if mine is None:
            return
        if blocked is not None:
            mine[shm.W_OP_SEQ] = blocked
        if done is not None:
            mine[shm.W_OP_DONE] = done

    # -- closing --------------------------------------------------------------------------

    def close(self) -> bool:
        """Release the segment; False while a view into it is still alive elsewhere (the
        caller drops what holds one and calls again)."""
        if self._drainer is not None:
            self._drainer.close()
            self._drainer = None
        if self._host is not None:
            self._host.close()  # lets go of the mapping, which cannot close while held
            self._host = None
        with self._watch_lock:
            self._watch.close()
        seg = self.seg
        if seg is None:
            return True
        if self._my_ctl is not None:
            seg.ctl[seg.me, shm.W_CLOSED] = 1
        # Drop every view into the segment: Python 3.11's mmap keeps a duplicate of the
        # file descriptor until it is closed, and it can close only with no view alive.
        self._chans.clear()
        self._senders.clear()
        self._my_ctl = None
        self.bell, self.p2p_bell = private_bell(), private_bell()
        if seg.close():
            self.seg = None
            return True
        return False
