"""Ordering and progress of one communicator's collectives.

Collectives complete in issue order on every rank. A synchronous operation on an idle
communicator runs on the caller's thread: handing it to another thread costs ~12 us here
(docs/DESIGN.md), more than a small shared-memory exchange. Anything else (async
operations, operations issued behind queued ones) goes through this communicator's
progress thread, started at the first such operation.

Each operation gets the next sequence number and a flight-recorder slot (no lock of its
own, no formatting: plait.flightrec). A failure that is not a ``ClosedError`` breaks the
communicator: later operations raise at once, naming the first failure.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import ClosedError, PlaitError
from .flightrec import ENDED, ERROR, ISSUED, STARTED, FlightRecorder
from .health import Health
from .transport.base import OpCtx
from .work import Work

OpFn = Callable[[OpCtx], None]


class Sequencer:
    def __init__(self, rank: int, timeout: float, recorder: FlightRecorder, health: Health,
                 mark_done: Callable[[int], None] | None) -> None:
        self.rank = rank
        self.timeout = timeout
        self.rec = recorder
        self.health = health
        # writes the sequence number of each finished collective where local peers read it
        # (their timeout reports): one store on the hot path
        self.mark_done = mark_done
        self.seq = 0
        self.completed = 0  # the last collective that completed here (in issue order)
        self.closed = False
        self.broken: BaseException | None = None
        self.cur: OpCtx | None = None
        # the bare lock where no one needs waking: a Condition's enter/exit costs twice
        # as much, on the path of every small synchronous operation
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: deque[tuple[int, str, OpFn, Work]] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None

    def current(self) -> OpCtx | None:
        """The running operation (for error messages and status reports)."""
        return self.cur

    def check_usable(self, op: str) -> None:
        if self.closed:
            raise ClosedError(f"rank {self.rank}, {op}: the communicator is closed")
        if self.broken is not None:
            raise PlaitError(f"rank {self.rank}, {op}: the communicator is unusable after an "
                             f"earlier failure: {self.broken}") from self.broken

    def submit(self, name: str, fn: OpFn, async_op: bool, nbytes: int = 0, dtype: Any = None,
               algo: str = "") -> Work | None:
        if not async_op and self.run_inline(name, fn, nbytes, dtype, algo):
            return None
        with self._cv:
            self.check_usable(name)
            self.seq += 1
            seq = self.seq
            slot = [seq, name, nbytes, dtype, algo, 0.0, 0.0, 0.0, None]
            slot[ISSUED] = time.monotonic()
            self.rec.slots[seq & self.rec.mask] = slot
            work = Work()
            self._queue.append((seq, name, fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"plait-progress-r{self.rank}")
                self._thread.start()
            self._cv.notify_all()
        if async_op:
            return work
        work.wait()
        return None

    def run_inline(self, name: str, fn: OpFn, nbytes: int = 0, dtype: Any = None,
                   algo: str = "") -> bool:
        """Run a synchronous operation now, on the caller's thread, if the communicator
        is idle and usable; False (nothing done, no sequence number taken) otherwise."""
        with self._lock:
            if self._busy or self._queue or self.closed or self.broken is not None:
                return False
            self._busy = True
            self.seq += 1
            seq = self.seq
        # a synchronous op is issued as it starts (ISSUED stays 0)
        self.rec.slots[seq & self.rec.mask] = [seq, name, nbytes, dtype, algo, 0.0, 0.0, 0.0,
                                               None]
        try:
            self._execute(name, seq, fn)
        finally:
            self._busy = False
            # an operation queued while this one ran: wake the progress thread (it
            # waits for busy to clear; enqueuers notify under the lock, so this read
            # after clearing busy misses none)
            if self._queue:
                with self._cv:
                    self._cv.notify_all()
        return True

    def _execute(self, name: str, seq: int, fn: OpFn) -> None:
        if self.broken is not None:
            self.check_usable(name)
        t0 = time.monotonic()
        health = self.health
        ctx = OpCtx(self.rank, name, seq, t0 + self.timeout, self.timeout,
                    health.timeout_error)
        self.cur = ctx
        slot = self.rec.slots[seq & self.rec.mask]
        slot[STARTED] = t0  # type: ignore[index]
        try:
            fn(ctx)
        except BaseException as exc:
            # a peer failure raised by a sub-communicator names its ranks: name ours
            err = health.adopt(exc, ctx)
            slot[ERROR] = f"{type(err).__name__}: {err}"  # type: ignore[index]
            if isinstance(err, (PlaitError, OSError)) and not isinstance(err, ClosedError):
                self.broken = err
                health.on_failure(err)
            if err is exc:
                raise
            raise err from exc
        slot[ENDED] = time.monotonic()  # type: ignore[index]
        self.completed = seq
        if self.mark_done is not None:
            self.mark_done(seq)
        if health.status_seq == seq:  # it said "waiting" in the store: now done
            health.done(name, seq)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (self._busy or not self._queue) and not self.closed:
                    self._cv.wait()
                if not self._queue:
                    return
                seq, name, fn, work = self._queue.popleft()
                self._busy = True
            try:
                self._execute(name, seq, fn)
            except BaseException as exc:
                work.fail(exc)
            else:
                work.finish()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    # -- closing --------------------------------------------------------------------------

    def shut(self) -> tuple[list[Work], bool] | None:
        """Refuse new operations; return (queued works, whether one is running), or None
        if already shut."""
        with self._cv:
            if self.closed:
                return None
            self.closed = True
            self._cv.notify_all()
            pending = [w for _, _, _, w in self._queue]
            self._queue.clear()
            return pending, self._busy

    def drain(self) -> None:
        """Wait for the progress thread, and for a synchronous operation on another thread
        to leave the transports (it sees ``closed`` at its next check)."""
        me = threading.current_thread()
        if self._thread is not None and self._thread is not me:
            self._thread.join(timeout=10)
        end = time.monotonic() + 5
        while self._busy and time.monotonic() < end and self._thread is not me:
            time.sleep(0.002)
