"""Run every rank's schedule in one process, on numpy arrays, with no transport.

The oracle for the peer math (property tests for world sizes 1-64) and the engine the
cost model and the flow-per-link analysis reuse: ``simulate`` returns each rank's final
buffers and the list of steps in which each message travelled.

Sends are buffered (a per-pair FIFO), so a rank's step completes once every receive of the
step has a message; a schedule whose receives can never be matched raises ``Deadlock``.
Message sizes must agree between sender and receiver.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..topology.model import Topology
from ..topology.order import Link, links
from .schedule import Copy, Recv, Reduce, Schedule, Send


class Deadlock(RuntimeError):
    pass


@dataclass(frozen=True)
class Flow:
    """A message: sender, receiver, elements, and the sender's step index."""

    src: int
    dst: int
    count: int
    step: int


def simulate(scheds: Sequence[Schedule], inputs: Sequence[np.ndarray | None],
             outputs: Sequence[np.ndarray | None],
             reduce: Callable[[np.ndarray, np.ndarray], None] | None = None,
             in_place: bool = False) -> list[Flow]:
    n = len(scheds)
    tmps = [np.zeros(s.tmp, dtype=_dtype(inputs, outputs)) for s in scheds]
    bufs = [(inputs[r] if not in_place else outputs[r], outputs[r], tmps[r]) for r in range(n)]
    pos = [0] * n
    started = [False] * n
    queues: dict[tuple[int, int], deque[tuple[np.ndarray, int]]] = {}
    flows: list[Flow] = []
    progress = True
    while progress:
        progress = False
        for r in range(n):
            steps = scheds[r].steps
            while pos[r] < len(steps):
                step = steps[pos[r]]
                if not started[r]:
                    _check_disjoint(r, pos[r], step.xfers)
                    for op in step.local:
                        src = bufs[r][op.src]
                        dst = bufs[r][op.dst]
                        assert src is not None and dst is not None
                        s = src[op.src_off:op.src_off + op.count]
                        d = dst[op.dst_off:op.dst_off + op.count]
                        if isinstance(op, Copy):
                            d[...] = s
                        else:
                            assert isinstance(op, Reduce) and reduce is not None
                            reduce(d, s)
                    for x in step.xfers:
                        if isinstance(x, Send):
                            b = bufs[r][x.buf]
                            data = (b[x.off:x.off + x.count].copy() if b is not None
                                    else np.empty(0))
                            queues.setdefault((r, x.peer), deque()).append((data, pos[r]))
                            flows.append(Flow(r, x.peer, x.count, pos[r]))
                    started[r] = True
                    progress = True
                ready = True
                need: dict[int, int] = {}
                for x in step.xfers:
                    if isinstance(x, Recv):
                        need[x.peer] = need.get(x.peer, 0) + 1
                for peer, k in need.items():
                    if len(queues.get((peer, r), ())) < k:
                        ready = False
                if not ready:
                    break
                for x in step.xfers:
                    if isinstance(x, Recv):
                        data, _ = queues[(x.peer, r)].popleft()
                        if len(data) != x.count:
                            raise ValueError(f"rank {r} step {pos[r]}: expected {x.count} "
                                             f"elements from rank {x.peer}, got {len(data)}")
                        b = bufs[r][x.buf]
                        assert b is not None
                        if x.reduce:
                            assert reduce is not None
                            reduce(b[x.off:x.off + x.count], data)
                        else:
                            b[x.off:x.off + x.count] = data
                pos[r] += 1
                started[r] = False
                progress = True
    stuck = [r for r in range(n) if pos[r] < len(scheds[r].steps)]
    if stuck:
        raise Deadlock(f"ranks {stuck} cannot finish (steps {[pos[r] for r in stuck]})")
    left = {k: len(v) for k, v in queues.items() if v}
    if left:
        raise Deadlock(f"messages never received: {left}")
    return flows


def flows_per_link(topo: Topology, flows: Iterable[Flow],
                   ranks: Sequence[int] | None = None) -> dict[tuple[int, Link], int]:
    """How many messages cross each link in each step. ``ranks`` maps the flows' ranks
    (those of a sub-communicator) to the topology's ranks. (Here, not in topology/order.py:
    topology is a lower layer than the algorithms and their flows.)"""
    out: dict[tuple[int, Link], int] = {}
    for f in flows:
        if f.count == 0:
            continue
        s, d = (f.src, f.dst) if ranks is None else (ranks[f.src], ranks[f.dst])
        for link in links(topo, s, d):
            out[(f.step, link)] = out.get((f.step, link), 0) + 1
    return out


def _check_disjoint(rank: int, index: int, xfers: tuple[Send | Recv, ...]) -> None:
    """A step's receives must not write what its sends read, nor what another receive
    writes: the executor runs them concurrently."""
    for i, a in enumerate(xfers):
        if not isinstance(a, Recv) or a.count == 0:
            continue
        for j, b in enumerate(xfers):
            if i == j or b.buf != a.buf or b.count == 0:
                continue
            if a.off < b.off + b.count and b.off < a.off + a.count:
                raise ValueError(f"rank {rank} step {index}: receive into [{a.off}, "
                                 f"{a.off + a.count}) overlaps [{b.off}, {b.off + b.count})")


def _dtype(inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None]
           ) -> np.dtype:
    for a in list(inputs) + list(outputs):
        if a is not None:
            return a.dtype
    return np.dtype(np.float64)
