"""Multi-stream TCP: one peer connection made of ``PLAIT_NSOCKS`` sockets, with large
messages cut into frames that the sockets pull as they go.

Each socket has a sender thread that takes the next frame from a shared queue when the
kernel has taken its previous one. A socket whose path is slower (an ECMP/LAG hash
collision, a slower rail) takes fewer frames instead of holding the message back, as it
would with static striping. ``TCP_NOTSENT_LOWAT`` keeps each socket's unsent backlog
small, so that what a slow socket has already taken when the queue runs dry is little
(with a 4 MiB send buffer, a 100 Mbit path would still be draining 8 MiB for 0.7 s after
a 200 Mbit path had finished).

Frames carry their offset and the receiver matches them by key (collectives: sequence
number and message index; point to point: source and sequence number, opened in sequence
order, see p2p.Engine), so frames of one message may arrive on any socket, in any order.
Small messages (one frame) go on the first socket from the caller's thread, as before.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from ..errors import ClosedError, PeerFailedError
from . import wire
from .base import THREAD, Request
from .futex import Bell
from .tcp import Outbound, send_all

STRIPE_FRAME = 256 << 10
"""Frame size of striped messages: the granularity at which sockets pull work. Small
enough that the last frame on a slow path costs little, large enough that per-frame
Python overhead (~10 us) is negligible."""

NOTSENT_LOWAT = 256 << 10
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)

Done = Callable[[BaseException | None], None]


def tune_stream(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
    except OSError:
        pass


class _Job:
    __slots__ = ("done", "left")

    def __init__(self, frames: int, done: Done) -> None:
        self.left = frames
        self.done = done


class Striper:
    """The sockets of one connection beyond the first, and a sender thread per socket."""

    def __init__(self, out: Outbound, extra: list[socket.socket], rank: int) -> None:
        self.out = out
        self.socks = [out.sock, *extra]
        self.locks = [out.lock] + [threading.Lock() for _ in extra]
        self.frame = min(out.max_frame, STRIPE_FRAME)
        self.cv = threading.Condition()
        self.queue: deque[tuple[_Job, bytes, np.ndarray]] = deque()
        self.closed = False
        self.error: BaseException | None = None
        for s in self.socks:
            tune_stream(s)
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True,
                                         name=f"plait-stream-r{rank}-{out.peer}.{i}")
                        for i in range(len(self.socks))]
        for t in self.threads:
            t.start()

    def submit(self, kind: int, tag: int, seq: int, payload: np.ndarray, done: Done) -> None:
        """Queue every frame of one message; ``done(None)`` once the kernel has taken the
        last one, ``done(exc)`` if the connection breaks first."""
        total = len(payload)
        offs = list(range(0, total, self.frame)) or [0]
        job = _Job(len(offs), done)
        with self.cv:
            err = self.error or (ClosedError("connection closed") if self.closed else None)
            if err is None:
                for off in offs:
                    n = min(self.frame, total - off)
                    hdr = wire.pack_header(kind, tag, seq, off, n, total)
                    self.queue.append((job, hdr, payload[off:off + n]))
                self.cv.notify_all()
        if err is not None:
            done(err)

    def send_message(self, kind: int, tag: int, seq: int, payload: np.ndarray) -> None:
        """Blocking: returns when every frame is in the kernel (the buffer may be reused)."""
        ev = threading.Event()
        box: list[BaseException | None] = [None]

        def done(exc: BaseException | None) -> None:
            box[0] = exc
            ev.set()

        self.submit(kind, tag, seq, payload, done)
        ev.wait()
        if box[0] is not None:
            raise box[0]

    def _loop(self, i: int) -> None:
        sock, lock = self.socks[i], self.locks[i]
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                job, hdr, view = self.queue.popleft()
            try:
                with lock:
                    if self.out.broken is not None:
                        raise self.out.broken
                    send_all(sock, [hdr, view]) if len(view) else sock.sendall(hdr)
            except (OSError, PeerFailedError) as exc:
                self._fail(exc)
                job.done(self.error)
                return
            with self.cv:
                job.left -= 1
                last = job.left == 0
            if last:
                job.done(None)

    def _fail(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, PeerFailedError) else PeerFailedError(
            f"connection to rank {self.out.peer} broke: {exc}", self.out.peer)
        with self.cv:
            if self.error is None:
                self.error = err
            self.out.broken = self.out.broken or self.error
            doomed = {id(j): j for j, _, _ in self.queue}
            self.queue.clear()
            self.cv.notify_all()
        for j in doomed.values():
            j.done(self.error)

    def close(self) -> None:
        """Stop the senders (failing queued messages), then say goodbye on and close the
        extra sockets; the Outbound closes the first."""
        with self.cv:
            self.closed = True
            doomed = {id(j): j for j, _, _ in self.queue}
            self.queue.clear()
            self.cv.notify_all()
        for j in doomed.values():
            j.done(ClosedError("the connection was closed"))
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join(timeout=5)
        for s, lock in zip(self.socks[1:], self.locks[1:], strict=True):
            with lock:
                try:
                    if self.out.broken is None:
                        s.sendall(wire.pack_header(wire.KIND_BYE, 0, 0, 0, 0, 0))
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


class StripedSend(Request):
    """A collective's message to one peer, striped: queued whole at the first
    ``progress()``, done when the sender threads have handed every frame to the kernel
    (they ring this rank's doorbell then)."""

    __slots__ = ("bell", "error", "finished", "idx", "seq", "src", "striper", "submitted")
    is_send = True
    driven_by = THREAD

    def __init__(self, peer: int, striper: Striper, src: np.ndarray, seq: int, idx: int,
                 bell: Bell) -> None:
        super().__init__(peer)
        self.striper, self.src, self.seq, self.idx, self.bell = striper, src, seq, idx, bell
        self.submitted = False
        self.finished = False
        self.error: BaseException | None = None

    def _done(self, exc: BaseException | None) -> None:
        self.error = exc
        self.finished = True
        self.bell.ring()

    def progress(self) -> bool:
        if self.done:
            return False
        if not self.submitted:
            self.submitted = True
            self.striper.submit(wire.KIND_COLL, self.idx, self.seq, self.src, self._done)
            return True
        if self.finished:
            if self.error is not None:
                raise self.error
            self.done = True
            return True
        return False
