"""Linear gather and scatter: the root exchanges with every rank at once.

Gather: every rank sends its block to the root, which posts all receives in one step.
Scatter: the root sends block i to rank i, all in one step. The root's link carries
(n-1)/n S: optimal in bandwidth for one root. Cost: (n-1) alpha + (n-1)/n S beta.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import IN, OUT, Copy, Recv, Schedule, Send, Step


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
