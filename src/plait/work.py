"""``Work``: the handle of an asynchronous operation.

Whoever runs the operation completes its Work once, with ``finish`` or ``fail``; the user
waits on it. Callbacks (the torch backend's futures) run on the completing thread.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

from .config import to_seconds
from .errors import CommTimeoutError, timed_out

log = logging.getLogger("plait")


class Work:
    """The handle of an asynchronous operation."""

    __slots__ = ("_callbacks", "_event", "_exc", "_lock", "_timeout", "_what", "source")

    def __init__(self, timeout: float | None = None, what: str = "") -> None:
        # ``timeout``: the deadline of an operation that nothing else times out (a posted
        # receive); wait() without a timeout of its own gives up after it.
        self._timeout = timeout
        self._what = what
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Work], Any]] | None = []
        self.source: int | None = None

    # -- completion (by the layer that runs the operation) --------------------------------

    def finish(self, source: int | None = None) -> None:
        """Complete successfully; ``source``: the sender's rank, for receives."""
        self.source = source
        self._complete()

    def fail(self, exc: BaseException) -> None:
        """Complete with ``exc``, raised by ``wait``."""
        self._exc = exc
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:
                log.exception("plait: a Work callback raised")

    # -- the user's side ---------------------------------------------------------------------

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until done; raise the operation's error, or CommTimeoutError if this wait's
        own ``timeout`` expires first (the operation keeps running)."""
        t = None if timeout is None else to_seconds(timeout, 0.0)
        if t is None and self._timeout is not None:
            if not self._event.wait(self._timeout):
                raise CommTimeoutError(f"{self._what}: {timed_out(self._timeout)} for it "
                                       "to complete (the communicator's timeout, "
                                       f"{self._timeout:g} s)")
        elif not self._event.wait(t):
            raise CommTimeoutError(f"Work.wait: {timed_out(t)} for the operation to complete "
                                   f"(this wait's timeout, {t:g} s; the operation is still "
                                   "running)")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._exc if self._event.is_set() else None

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Call ``fn(work)`` once when the work completes (at once if it has)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)


def done_work(source: int | None = None) -> Work:
    """A Work that has already completed."""
    w = Work()
    w.finish(source)
    return w
