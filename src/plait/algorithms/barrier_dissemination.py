"""Dissemination barrier: ceil(log2 n) rounds for any n.

In round k = 1, 2, 4, ... rank r signals rank r+k and waits for rank r-k (empty messages).
After the last round every rank has heard, transitively, from every other.
Cost: ceil(log2 n) alpha.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import OUT, Args, Counts, Recv, Schedule, Send, Step, ceil_log2


@lru_cache(maxsize=64)
def schedule(rank: int, size: int) -> Schedule:
    steps = []
    k = 1
    while k < size:
        steps.append(Step(xfers=(Send((rank + k) % size, OUT, 0, 0),
                                 Recv((rank - k) % size, OUT, 0, 0))))
        k <<= 1
    return Schedule(tuple(steps), name="dissemination")


def plan(op: str, a: Args) -> Schedule:
    del op  # barrier only
    return schedule(a.rank, a.size)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """ceil(log2 n) rounds of one empty message per rank."""
    del op, nbytes
    steps = ceil_log2(n)
    return Counts(steps, n * steps, 0)
