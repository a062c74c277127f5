"""Blocking on a 32-bit word in (shared) memory with the Linux futex syscall.

A :class:`Bell` is one futex word plus a "sleeping" flag. Whoever publishes something a
waiter may be waiting for bumps the bell and calls ``futex_wake`` only if the waiter says
it sleeps, so the common (spinning) case costs one store and no syscall. The waiter reads
the bell before re-checking its condition and sleeps only while the bell still has that
value, so a publication between its check and its sleep is not lost; every sleep also has
a bounded timeout as a backstop.
"""

from __future__ import annotations

import ctypes
import os
import platform

import numpy as np

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine(), 202)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected``, at most ``timeout_s``."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected),
             ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


class Bell:
    """A doorbell: ``words[0]`` is the futex word, ``words[1]`` the sleeping flag.

    ``words`` is an int32 numpy view of two words in shared memory (or private memory for
    waking threads of one process); ``addr`` is the address of ``words[0]``.
    """

    __slots__ = ("addr", "words")

    def __init__(self, words: np.ndarray) -> None:
        # a memoryview reads and writes plain ints several times faster than numpy indexing
        self.words = memoryview(words)
        self.addr = words.ctypes.data

    def ring(self) -> None:
        w = self.words
        w[0] = (w[0] + 1) & 0x3FFFFFFF
        if w[1]:
            futex_wake(self.addr)

    def snapshot(self) -> int:
        """Mark this side as about to sleep and read the bell; then re-check, then sleep."""
        self.words[1] = 1
        return self.words[0]

    def sleep(self, seen: int, timeout_s: float) -> None:
        futex_wait(self.addr, seen, timeout_s)

    def awake(self) -> None:
        self.words[1] = 0


def private_bell() -> Bell:
    """A bell in private memory, for waking threads of this process only."""
    return Bell(np.zeros(16, dtype=np.int32)[:2])  # the view keeps its base alive


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
