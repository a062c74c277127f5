"""Binomial-tree broadcast, for small messages.

Ranks are renumbered relative to the root (v = (r - root) mod n). At step i, every v < 2^i
that holds the data sends it to v + 2^i. ceil(log2 n) steps; each rank receives once and
sends at most log2 n times. Cost: ceil(log2 n) (alpha + S beta).
"""

from __future__ import annotations

from functools import lru_cache

from .peers import binomial_children, binomial_parent
from .schedule import OUT, Args, Counts, Recv, Schedule, Send, Step, ceil_log2


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, count: int, root: int) -> Schedule:
    v = (rank - root) % size
    steps: list[Step] = []
    parent = binomial_parent(v)
    if parent is not None:
        steps.append(Step(xfers=(Recv((parent + root) % size, OUT, 0, count),)))
    for child in binomial_children(v, size):
        steps.append(Step(xfers=(Send((child + root) % size, OUT, 0, count),)))
    return Schedule(tuple(steps), name="tree")


def plan(op: str, a: Args) -> Schedule:
    del op  # broadcast only
    return schedule(a.rank, a.size, a.counts[0], a.root)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """The root sends ceil(log2 n) times (no other rank has more steps: one receive plus
    fewer children); every rank but the root receives the whole buffer once."""
    del op
    return Counts(ceil_log2(n), n - 1, (n - 1) * nbytes)
