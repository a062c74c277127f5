"""Runs schedules on channels, and waits without burning a core.

The executor knows requests only through the transport interface (transport/base.py):
``progress()``, ``done``, ``is_send`` and ``driven_by``. Waiting spins for a short while (a
peer usually answers within microseconds) when progress is made by the waiting thread
itself, then sleeps on this rank's doorbell (a futex word that peers and reader threads
ring) with a bounded timeout, re-checking the deadline and the communicator's failure
state each time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .algorithms import registry
from .algorithms.schedule import Copy, Schedule, Send
from .calls import Call
from .reduce import Reducer
from .transport.base import CALLER, Channel, OpCtx, Request
from .transport.futex import Bell

MAX_SLEEP_S = 0.05


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


def _progress_all(reqs: list[Request]) -> bool:
    moved = False
    for r in reqs:
        if not r.done and r.progress():
            moved = True
    return moved


def run(ctx: OpCtx, sched: Schedule, inbuf: np.ndarray | None, outbuf: np.ndarray | None,
        reducer: Reducer | None, storage: np.dtype, channel: Callable[[int], Channel],
        waiter: Waiter) -> None:
    """Execute ``sched`` for this rank. Buffers are flat numpy views of storage dtype;
    ``channel(peer)`` gives the channel to a peer."""
    tmp = np.empty(sched.tmp, dtype=storage)
    bufs = (inbuf, outbuf, tmp)
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
        reqs: list[Request] = []
        for x in step.xfers:
            buf = bufs[x.buf]
            assert buf is not None or x.count == 0
            view = buf[x.off:x.off + x.count] if buf is not None else np.empty(0, storage)
            is_send = isinstance(x, Send)
            key = (x.peer, is_send)
            idx = msg_idx.get(key, 0)
            msg_idx[key] = idx + 1
            ch = channel(x.peer)
            if is_send:
                reqs.append(ch.send(view.view(np.uint8), ctx, idx))
            else:
                reqs.append(ch.recv(view, reducer if x.reduce else None, ctx, idx))
        wait_reqs(ctx, reqs, waiter)


def wait_reqs(ctx: OpCtx, reqs: list[Request], waiter: Waiter) -> None:
    """Progress ``reqs`` until every one is done."""
    pending = reqs

    def ready() -> bool:
        nonlocal pending
        while _progress_all(pending):
            pass
        pending = [r for r in pending if not r.done]
        return not pending

    def waiting_for() -> str:
        sends = sorted({r.peer for r in pending if r.is_send})
        recvs = sorted({r.peer for r in pending if not r.is_send})
        parts = []
        if recvs:
            parts.append("data from rank " + ", ".join(map(str, recvs)))
        if sends:
            parts.append("rank " + ", ".join(map(str, sends)) + " to take data")
        return " and ".join(parts) or "nothing"

    local_only = all(r.driven_by == CALLER for r in reqs)
    waiter.wait(ready, ctx, waiting_for, spin=local_only)


class Plans:
    """The schedule of each call shape of one communicator, built once: building the
    planner's Args and the schedule costs more than a lookup."""

    def __init__(self, rank: int, size: int, order: Sequence[int]) -> None:
        self.rank = rank
        self.size = size
        self.order = order
        self._plans: dict[tuple[Any, ...], Schedule] = {}

    def plan(self, alg: registry.Algorithm, call: Call) -> Schedule:
        if alg.plan is None:
            raise AssertionError(f"algorithm {alg.name} has no schedule")
        arr = call.recv if call.recv is not None else call.send
        itemsize = arr.dtype.itemsize if arr is not None else 1
        key = (alg.name, call.op, tuple(call.counts), tuple(call.recv_counts), call.root,
               itemsize)
        sched = self._plans.get(key)
        if sched is None:
            args = registry.Args(rank=self.rank, size=self.size, counts=key[2],
                                 recv_counts=key[3], root=call.root, itemsize=itemsize,
                                 order=self.order)
            sched = alg.plan(call.op, args)
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[key] = sched
        return sched
