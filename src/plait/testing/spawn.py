"""Run a test's worker in ``n`` fresh processes (spawned, not forked) that meet through a
TCPStore on a free port, and collect what they put on a queue: for tests that need their
own process tree (kills, init arguments) rather than the harness's pools."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(worker: Callable[..., None], n: int, *args: Any, expect: int | None = None,
              timeout: float = 60.0) -> list[Any]:
    """``worker(rank, port, *args, queue)`` in ``n`` processes; the ``expect`` (default
    ``n``) items they put, sorted. Processes still alive afterwards are killed, by PID."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=timeout) for _ in range(n if expect is None else expect))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
