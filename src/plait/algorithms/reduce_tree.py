"""Binomial-tree reduce.

The mirror of the tree broadcast: relative rank v receives and reduces the partial
results of its children (smallest subtree first: it is ready first), then sends its
partial result to its parent. The root reduces into OUT (its own buffer, in place);
other ranks accumulate in TMP so that their buffers are left unchanged.
Cost: ceil(log2 n) (alpha + S beta + S gamma).
"""

from __future__ import annotations

from functools import lru_cache

from .peers import binomial_children, binomial_parent
from .schedule import (
    IN,
    OUT,
    TMP,
    Args,
    Copy,
    Counts,
    Recv,
    Reduce,
    Schedule,
    Send,
    Step,
    ceil_log2,
)


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, count: int, root: int) -> Schedule:
    v = (rank - root) % size
    acc, acc_off = (OUT, 0) if v == 0 else (TMP, count)
    steps: list[Step] = []
    if v != 0:
        steps.append(Step(local=(Copy(IN, 0, TMP, count, count),)))
    for child in binomial_children(v, size):
        steps.append(Step(xfers=(Recv((child + root) % size, TMP, 0, count),)))
        steps.append(Step(local=(Reduce(TMP, 0, acc, acc_off, count),)))
    parent = binomial_parent(v)
    if parent is not None:
        steps.append(Step(xfers=(Send((parent + root) % size, acc, acc_off, count),)))
    return Schedule(tuple(steps), tmp=2 * count if size > 1 else 0, name="tree")


def plan(op: str, a: Args) -> Schedule:
    del op  # reduce only
    return schedule(a.rank, a.size, a.counts[0], a.root)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """The mirror of the tree broadcast: the root receives ceil(log2 n) times; every rank
    but the root sends its partial result (the whole buffer) once."""
    del op
    return Counts(ceil_log2(n), n - 1, (n - 1) * nbytes)
