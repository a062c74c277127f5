"""Runs schedules on transports, and waits without burning a core.

Waiting spins for a short while (a peer usually answers within microseconds), then
sleeps on this rank's doorbell (a futex word that peers and reader threads ring) with a
bounded timeout, re-checking the deadline and the communicator's failure state each time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .algorithms.schedule import Copy, Recv, Schedule, Send
from .errors import CommTimeoutError
from .reduce import Reducer
from .transport.channels import Req, ShmRecv, ShmSend, TcpSend
from .transport.futex import Bell

if TYPE_CHECKING:
    from .comm import Communicator

MAX_SLEEP_S = 0.05


class OpCtx:
    """What an error message needs to know about the running operation."""

    __slots__ = ("comm", "deadline", "name", "seq")

    def __init__(self, comm: Communicator, name: str, seq: int, deadline: float) -> None:
        self.comm = comm
        self.name = name
        self.seq = seq
        self.deadline = deadline

    @property
    def where(self) -> str:
        return f"rank {self.comm.rank}, {self.name} #{self.seq}"

    def timeout_error(self, waiting_for: str) -> CommTimeoutError:
        """The error, with where every rank is (plait.health) and the flight record logged."""
        return self.comm._health.timeout_error(
            self, f"{self.where}: timed out after {self.comm.timeout:g} s waiting for "
                  f"{waiting_for}")


class Waiter:
    """Spin, then sleep on ``bell``, until ``ready()``; raise on deadline or failure."""

    def __init__(self, bell: Bell, spin_s: float, check: Callable[[], None],
                 yield_cpu: bool = False) -> None:
        self.bell = bell
        self.spin_s = spin_s
        self.check = check
        # with more ranks than cores, spinning steals the core from the rank we wait for
        self.yield_cpu = yield_cpu

    def wait(self, ready: Callable[[], bool], ctx: OpCtx,
             waiting_for: Callable[[], str], spin: bool = True) -> None:
        """``spin=False`` when progress comes from a thread of this process (TCP readers):
        spinning would hold the GIL that thread needs, for up to the interpreter's switch
        interval (5 ms), so sleep on the bell at once; the reader rings it."""
        if ready():
            return
        now = time.monotonic()
        spin_until = now + (self.spin_s if spin else 0.0)
        while True:
            if ready():
                return
            now = time.monotonic()
            if now < spin_until:
                if self.yield_cpu:
                    os.sched_yield()
                continue
            self.check()
            if now > ctx.deadline:
                raise ctx.timeout_error(waiting_for())
            seen = self.bell.snapshot()
            try:
                if ready():
                    return
                self.bell.sleep(seen, min(MAX_SLEEP_S, max(ctx.deadline - now, 0.001)))
            finally:
                self.bell.awake()


def _progress_all(reqs: list[Req]) -> bool:
    moved = False
    for r in reqs:
        if not r.done and r.progress():
            moved = True
    return moved


def run(comm: Communicator, ctx: OpCtx, sched: Schedule, inbuf: np.ndarray | None,
        outbuf: np.ndarray | None, reducer: Reducer | None, storage: np.dtype) -> None:
    """Execute ``sched`` for this rank. Buffers are flat numpy views of storage dtype."""
    tmp = np.empty(sched.tmp, dtype=storage)
    bufs = (inbuf, outbuf, tmp)
    chans = comm._channels
    msg_idx: dict[tuple[int, bool], int] = {}
    for step in sched.steps:
        for op in step.local:
            src = bufs[op.src]
            dst = bufs[op.dst]
            assert src is not None and dst is not None
            s = src[op.src_off:op.src_off + op.count]
            d = dst[op.dst_off:op.dst_off + op.count]
            if isinstance(op, Copy):
                if s.ctypes.data != d.ctypes.data:
                    np.copyto(d, s)
            else:
                assert reducer is not None
                reducer(d, s)
        if not step.xfers:
            continue
        reqs: list[Req] = []
        for x in step.xfers:
            buf = bufs[x.buf]
            assert buf is not None or x.count == 0
            view = buf[x.off:x.off + x.count] if buf is not None else np.empty(0, storage)
            key = (x.peer, isinstance(x, Send))
            idx = msg_idx.get(key, 0)
            msg_idx[key] = idx + 1
            ch = chans(x.peer, ctx)
            if isinstance(x, Send):
                reqs.append(ch.send(view.view(np.uint8), ctx, idx))
            else:
                assert isinstance(x, Recv)
                reqs.append(ch.recv(view, reducer if x.reduce else None, ctx, idx))
        wait_reqs(comm, ctx, reqs)


def wait_reqs(comm: Communicator, ctx: OpCtx, reqs: list[Req]) -> None:
    pending = reqs

    def ready() -> bool:
        nonlocal pending
        while _progress_all(pending):
            pass
        pending = [r for r in pending if not r.done]
        return not pending

    def waiting_for() -> str:
        sends = sorted({r.peer for r in pending if isinstance(r, (ShmSend, TcpSend))})
        recvs = sorted({r.peer for r in pending if not isinstance(r, (ShmSend, TcpSend))})
        parts = []
        if recvs:
            parts.append("data from rank " + ", ".join(map(str, recvs)))
        if sends:
            parts.append("rank " + ", ".join(map(str, sends)) + " to take data")
        return " and ".join(parts) or "nothing"

    local_only = all(isinstance(r, (ShmSend, ShmRecv)) for r in reqs)
    comm._waiter.wait(ready, ctx, waiting_for, spin=local_only)

