"""Point-to-point messages: matching per (source, tag), in send order, never blocked by
collectives.

Receiving is done by threads that always drain: TCP reader threads, and for shared memory
one drainer thread per communicator (started at the first point-to-point call) that empties
the incoming point-to-point rings. A frame that opens a message is matched, in post order,
against posted receives (``src=None`` matches any source); unmatched messages wait in an
unexpected list until a receive claims them. So a receive posted before the send never
blocks the send, and sends complete as soon as the data is handed over.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import MismatchError, PeerFailedError
from .transport import wire
from .transport.channels import ShmRing
from .transport.futex import Bell
from .transport.shm import KIND_P2P, Segment

if TYPE_CHECKING:
    from .comm import Work

ReadInto = Callable[[np.ndarray], None]


class Recv:
    """A posted receive."""

    __slots__ = ("dst", "n", "src", "tag", "where", "work")

    def __init__(self, dst: np.ndarray, src: int | None, tag: int, work: Work, where: str) -> None:
        self.dst = dst
        self.n = len(dst)
        self.src = src
        self.tag = tag
        self.work = work
        self.where = where


class Msg:
    """An incoming message: its target is a posted receive or a buffer of its own."""

    __slots__ = ("buf", "claimed", "complete", "error", "got", "src", "tag", "total")

    def __init__(self, src: int, tag: int, total: int) -> None:
        self.src = src
        self.tag = tag
        self.total = total
        self.buf: np.ndarray | None = None
        self.claimed: Recv | None = None
        self.complete = False
        self.got = 0
        self.error: BaseException | None = None


class Engine:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.posted: list[Recv] = []
        self.unexpected: list[Msg] = []
        self.inflight: dict[tuple[int, int], Msg] = {}
        self.failed: dict[int, BaseException] = {}
        self._local_seq = 0
        # Messages open (are matched to receives) in sequence order per source: on a
        # multi-socket connection a later message's frame can arrive before an earlier
        # message's first frame. next_open[src] is the next sequence number to open;
        # early[src][seq] holds messages seen before their turn, in buffers of their own.
        self.next_open: dict[int, int] = {}
        self.early: dict[int, dict[int, Msg]] = {}

    # -- receiving side -------------------------------------------------------------------

    def post(self, req: Recv) -> None:
        finish: Msg | None = None
        with self.lock:
            for i, m in enumerate(self.unexpected):
                if m.tag == req.tag and (req.src is None or req.src == m.src):
                    del self.unexpected[i]
                    m.claimed = req
                    if m.complete:
                        finish = m
                    break
            else:
                if req.src is not None and req.src in self.failed:
                    req.work._fail(self.failed[req.src])
                    return
                self.posted.append(req)
        if finish is not None:
            self._finish_claimed(finish)

    def _size_error(self, req: Recv, m: Msg) -> MismatchError:
        return MismatchError(f"{req.where}: message from rank {m.src} with tag {m.tag} has "
                             f"{m.total} bytes but the receive buffer holds {req.n}")

    def _finish_claimed(self, m: Msg) -> None:
        req = m.claimed
        assert req is not None
        if m.error is not None:
            req.work._fail(m.error)
        elif m.total != req.n:
            req.work._fail(self._size_error(req, m))
        else:
            if m.buf is not None and m.total:
                np.copyto(req.dst, m.buf)
            req.work._finish(m.src)

    def on_frame(self, src: int, f: wire.Frame, read_into: ReadInto) -> None:
        """Called by a reader/drainer with ``f.length`` payload bytes still to read."""
        key = (src, f.seq)
        finish: list[Msg] = []
        with self.lock:
            m = self.inflight.get(key)
            if m is None:
                m = Msg(src, f.tag, f.total)
                nxt = self.next_open.get(src, 0)
                if f.seq == nxt:
                    self._open_locked(m)
                    nxt += 1
                    early = self.early.get(src)
                    while early and nxt in early:  # later messages that arrived first
                        e = early.pop(nxt)
                        self._open_locked(e)
                        if e.complete and e.claimed is not None:
                            finish.append(e)
                        nxt += 1
                    self.next_open[src] = nxt
                else:
                    m.buf = np.empty(f.total, dtype=np.uint8)
                    self.early.setdefault(src, {})[f.seq] = m
                self.inflight[key] = m
            target = m.buf if m.buf is not None else m.claimed.dst  # type: ignore[union-attr]
        for e in finish:
            self._finish_claimed(e)
        if f.length:
            read_into(target[f.offset:f.offset + f.length])
        with self.lock:
            m.got += f.length
            if m.got < m.total:
                return
            del self.inflight[key]
            m.complete = True
            claimed = m.claimed
        if claimed is not None:
            self._finish_claimed(m)

    def _open_locked(self, m: Msg) -> None:
        """Match a message whose turn has come to the first posted receive that fits, else
        queue it as unexpected."""
        for i, req in enumerate(self.posted):
            if req.tag == m.tag and (req.src is None or req.src == m.src):
                del self.posted[i]
                m.claimed = req
                break
        else:
            self.unexpected.append(m)
        if m.buf is None and (m.claimed is None or m.claimed.n != m.total):
            m.buf = np.empty(m.total, dtype=np.uint8)

    def deliver_local(self, tag: int, data: np.ndarray) -> None:
        """A message from this rank to itself."""
        with self.lock:
            seq = self._local_seq  # from 0, like every sender's sequence numbers
            self._local_seq += 1
        f = wire.Frame(wire.KIND_P2P, tag, seq, 0, len(data), len(data))

        def read(dst: np.ndarray) -> None:
            np.copyto(dst, data)

        self.on_frame(self.rank, f, read)

    def peer_failed(self, peer: int, exc: BaseException) -> None:
        with self.lock:
            self.failed[peer] = exc
            doomed = [r for r in self.posted if r.src == peer]
            self.posted = [r for r in self.posted if r.src != peer]
            partial = [m for (s, _), m in self.inflight.items() if s == peer]
        for r in doomed:
            r.work._fail(exc)
        for m in partial:
            m.error = exc
            if m.claimed is not None:
                m.claimed.work._fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        with self.lock:
            doomed = self.posted
            self.posted = []
        for r in doomed:
            r.work._fail(exc)


class ShmSender:
    """Writes point-to-point messages into the ring to one local peer."""

    def __init__(self, seg: Segment, me: int, peer_local: int, peer: int, my_bell: Bell,
                 peer_bell: Bell) -> None:
        self.ring = ShmRing(seg, KIND_P2P, me, peer_local)
        self.peer = peer
        self.my_bell = my_bell
        self.peer_bell = peer_bell
        self.lock = threading.Lock()
        self.seq = 0

    def send(self, tag: int, data: np.ndarray, wait_space: Callable[[Callable[[], bool]], None]
             ) -> None:
        r = self.ring
        with self.lock:
            seq = self.seq
            self.seq += 1
            total = len(data)
            nchunks = max(1, -(-total // r.chunk))
            ctl = r.ctl

            def has_space() -> bool:
                return int(ctl[0]) - int(ctl[8]) < r.nslots

            for i in range(nchunks):
                if not has_space():
                    wait_space(has_space)
                head = int(ctl[0])
                s = head % r.nslots
                off = i * r.chunk
                m = min(r.chunk, total - off)
                if m > 0:
                    np.copyto(r.payload[s, :m], data[off:off + m])
                h = r.hdr
                h[s, 0], h[s, 1], h[s, 2], h[s, 3], h[s, 4] = tag, seq, off, m, total
                ctl[0] = head + 1
                self.peer_bell.ring()


class Drainer:
    """The thread that empties this rank's incoming point-to-point rings."""

    def __init__(self, engine: Engine, rings: list[tuple[int, ShmRing, Bell]], bell: Bell,
                 spin_s: float, name: str) -> None:
        self.engine = engine
        self.rings = rings  # (peer rank, ring peer -> me, the peer's p2p bell)
        self.bell = bell
        self.spin_s = spin_s
        self.stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _pending(self) -> bool:
        return any(int(r.ctl[0]) != int(r.ctl[8]) for _, r, _ in self.rings)

    def _drain(self) -> bool:
        moved = False
        for peer, r, peer_bell in self.rings:
            ctl = r.ctl
            while int(ctl[8]) < int(ctl[0]):
                tail = int(ctl[8])
                s = tail % r.nslots
                h = r.hdr
                tag, seq, off, m, total = h[s, 0], h[s, 1], h[s, 2], h[s, 3], h[s, 4]
                f = wire.Frame(wire.KIND_P2P, tag, seq, off, m, total)
                payload = r.payload[s, :m]

                def read(dst: np.ndarray, _p: Any = payload) -> None:
                    np.copyto(dst, _p)

                self.engine.on_frame(peer, f, read)
                ctl[8] = tail + 1
                peer_bell.ring()
                moved = True
        return moved

    def _run(self) -> None:
        try:
            spin_until = 0.0
            while not self.stop:
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
            self.engine.fail_all(PeerFailedError(f"rank {self.engine.rank}: point-to-point "
                                                 f"receiver failed: {exc!r}"))

    def close(self) -> None:
        self.stop = True
        self.bell.ring()  # changes the word, so a sleep about to start returns at once
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
