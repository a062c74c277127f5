"""Point-to-point messages: matching per (source, tag), in send order, never blocked by
collectives.

Receiving is done by threads that always drain: TCP reader threads, and for shared memory
one drainer thread per communicator (started at the first point-to-point call) that empties
the incoming point-to-point rings (transport/shm_link.py). Sends to one peer keep their
order through a queue per peer (``SendQueue``); ``PointToPoint`` is the communicator's
side of all this. A frame that opens a message is matched, in post order,
against posted receives (``src=None`` matches any source); unmatched messages wait in an
unexpected list until a receive claims them. So a receive posted before the send never
blocks the send, and sends complete as soon as the data is handed over.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .errors import ClosedError, MismatchError
from .executor import Waiter
from .transport import wire
from .transport.base import OpCtx, ReadInto, Transport
from .transport.futex import Bell
from .work import Work, done_work


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
                    req.work.fail(self.failed[req.src])
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
            req.work.fail(m.error)
        elif m.total != req.n:
            req.work.fail(self._size_error(req, m))
        else:
            if m.buf is not None and m.total:
                np.copyto(req.dst, m.buf)
            req.work.finish(m.src)

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
            r.work.fail(exc)
        for m in partial:
            m.error = exc
            if m.claimed is not None:
                m.claimed.work.fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        with self.lock:
            doomed = self.posted
            self.posted = []
        for r in doomed:
            r.work.fail(exc)


class SendQueue:
    """Keeps sends to one peer in order; async sends progress on a thread of their own so
    that a send waiting for a slow receiver never holds up others."""

    def __init__(self, rank: int, peer: int) -> None:
        self.rank = rank
        self.peer = peer
        self.cv = threading.Condition()
        self.items: deque[tuple[Callable[[], None], Work]] = deque()
        self.busy = False
        self.closed = False
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None], async_op: bool) -> Work | None:
        with self.cv:
            if not async_op and not self.busy and not self.items:
                self.busy = True
                inline = True
            else:
                inline = False
                work = Work()
                self.items.append((fn, work))
                if self.thread is None:
                    self.thread = threading.Thread(target=self._loop, daemon=True,
                                                   name=f"plait-send-r{self.rank}-{self.peer}")
                    self.thread.start()
                self.cv.notify_all()
        if inline:
            try:
                fn()
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()
            return None
        if async_op:
            return work
        work.wait()
        return None

    def _loop(self) -> None:
        while True:
            with self.cv:
                while (self.busy or not self.items) and not self.closed:
                    self.cv.wait()
                if not self.items:
                    return
                fn, work = self.items.popleft()
                self.busy = True
            try:
                fn()
            except BaseException as exc:
                work.fail(exc)
            else:
                work.finish()
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            items = list(self.items)
            self.items.clear()
            self.cv.notify_all()
        for _, w in items:
            w.fail(ClosedError(f"rank {self.rank}: the communicator was closed"))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)


class Links(Protocol):
    """What point to point needs of the fabric."""

    p2p_bell: Bell
    spin_s: float

    def transport_for(self, peer: int) -> Transport: ...

    def start_p2p(self) -> None: ...


class PointToPoint:
    """One communicator's point-to-point side: the matching engine, a send queue per
    peer, and the transports' point-to-point paths."""

    def __init__(self, rank: int, timeout: float, check: Callable[[], None],
                 on_timeout: Callable[[OpCtx, str], BaseException],
                 seq: Callable[[], int]) -> None:
        self.rank = rank
        self.timeout = timeout
        self._links: Links | None = None  # bound once the transports are open
        self.check = check
        self.on_timeout = on_timeout
        self.seq = seq  # the communicator's collective sequence number, for messages
        self.engine = Engine(rank)
        self._queues: dict[int, SendQueue] = {}
        self._lock = threading.Lock()

    def bind(self, links: Links) -> None:
        """The transports, opened with ``engine`` as their point-to-point sink."""
        self._links = links

    @property
    def links(self) -> Links:
        if self._links is None:
            raise ClosedError(f"rank {self.rank}: the communicator is closed")
        return self._links

    def send(self, data: np.ndarray, dst: int, tag: int, op: str, async_op: bool
             ) -> Work | None:
        if dst == self.rank:
            self.engine.deliver_local(tag, data.copy())
            return done_work() if async_op else None
        self.links.start_p2p()
        q = self._queues.get(dst)
        if q is None:
            with self._lock:
                q = self._queues.setdefault(dst, SendQueue(self.rank, dst))
        return q.submit(lambda: self._send_now(dst, tag, data, op), async_op)

    def _send_now(self, dst: int, tag: int, data: np.ndarray, op: str) -> None:
        deadline = time.monotonic() + self.timeout
        ctx = OpCtx(self.rank, op, self.seq(), deadline, self.timeout, self.on_timeout)
        links = self.links
        waiter = Waiter(links.p2p_bell, links.spin_s, self.check)

        def wait_for(ready: Callable[[], bool], what: str) -> None:
            waiter.wait(ready, ctx, lambda: what)

        links.transport_for(dst).send_p2p(dst, tag, data, deadline, wait_for)

    def recv(self, dst: np.ndarray, src: int | None, tag: int, op: str) -> Work:
        self.links.start_p2p()
        who = "any rank" if src is None else f"rank {src}"
        where = f"rank {self.rank}, {op}"
        work = Work(self.timeout, f"{where} from {who} with tag {tag}")
        self.engine.post(Recv(dst, src, tag, work, where))
        return work

    def peer_failed(self, peer: int, exc: BaseException) -> None:
        self.engine.peer_failed(peer, exc)

    def close(self, exc: BaseException) -> None:
        self.engine.fail_all(exc)
        for q in list(self._queues.values()):
            q.close()
        self._links = None
