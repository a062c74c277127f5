"""Linear gather and scatter: the root exchanges with every rank at once.

Gather: every rank sends its block to the root, which posts all receives in one step.
Scatter: the root sends block i to rank i, all in one step. The root's link carries
(n-1)/n S: optimal in bandwidth for one root. Cost: (n-1) alpha + (n-1)/n S beta.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import IN, OUT, Args, Copy, Counts, Recv, Schedule, Send, Step


@lru_cache(maxsize=256)
def gather(rank: int, size: int, count: int, root: int) -> Schedule:
    if rank != root:
        return Schedule((Step(xfers=(Send(root, IN, 0, count),)),), name="linear")
    xfers = tuple(Recv(i, OUT, i * count, count) for i in range(size) if i != root)
    return Schedule((Step(local=(Copy(IN, 0, OUT, root * count, count),), xfers=xfers),),
                    name="linear")


@lru_cache(maxsize=256)
def scatter(rank: int, size: int, count: int, root: int) -> Schedule:
    if rank != root:
        return Schedule((Step(xfers=(Recv(root, OUT, 0, count),)),), name="linear")
    xfers = tuple(Send(i, IN, i * count, count) for i in range(size) if i != root)
    return Schedule((Step(local=(Copy(IN, root * count, OUT, 0, count),), xfers=xfers),),
                    name="linear")


def plan(op: str, a: Args) -> Schedule:
    fn = gather if op == "gather" else scatter
    return fn(a.rank, a.size, a.counts[0], a.root)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """One step; n - 1 messages of one rank's block (``nbytes // n``: ``nbytes`` is the
    root's whole buffer), to the root (gather) or from it (scatter)."""
    del op
    if n == 1:
        return Counts(0, 0, 0)
    return Counts(1, n - 1, (n - 1) * (nbytes // n))
