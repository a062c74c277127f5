"""What a communicator leaves behind: this process's fds, plait threads and /dev/shm
entries, compared before and after (the leak checks of the reliability and transport
contract tests)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from .harness import shm_entries


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def plait_threads() -> set[tuple[int | None, str]]:
    return {(t.ident, t.name) for t in threading.enumerate() if t.name.startswith("plait-")}


def resources(comm: Any) -> dict[str, Any]:
    """This process's fds and plait threads, after making the parent communicator open
    the connections a split will use (they are made lazily)."""
    comm.allgather(np.zeros(2, dtype=np.int64), np.empty(2 * comm.size, dtype=np.int64))
    return {"fds": fds(), "threads": plait_threads()}


def leaks(before: dict[str, Any], uid: str, settle: float = 3.0) -> list[str]:
    """What a closed communicator left behind, compared with ``before`` (threads and fds
    may take a moment to go: reader threads notice the shutdown of their socket)."""
    deadline = time.monotonic() + settle
    while True:
        problems = []
        new = fds() - before["fds"]
        # the listing itself opens an fd; count only fds that still resolve
        extra = []
        for fd in new:
            try:
                extra.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                pass
        if extra:
            problems.append(f"file descriptors left open: {extra}")
        threads = plait_threads() - before["threads"]
        if threads:
            problems.append(f"threads left running: {sorted(threads)}")
        shm_left = [n for n in shm_entries() if uid in n]
        if shm_left:
            problems.append(f"/dev/shm entries left: {shm_left}")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.1)
