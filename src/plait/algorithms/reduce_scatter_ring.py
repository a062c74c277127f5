"""Ring reduce-scatter.

Semantics: IN holds n blocks (block i has counts[i] elements); rank r receives the
reduction of every rank's block r in OUT. IN is left unchanged: work happens in TMP, a copy
of IN. At step k = 0..n-2 rank r sends block (r-k-1) to the right and receives block
(r-k-2) from the left, reducing it in; after n-1 steps TMP block r is complete.
Cost: (n-1) alpha + (n-1)/n S beta + (n-1)/n S gamma.
"""

from __future__ import annotations

from functools import lru_cache

from .peers import ring_neighbours
from .schedule import IN, OUT, TMP, Copy, Recv, Schedule, Send, Step, offsets


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, counts: tuple[int, ...]) -> Schedule:
    off = offsets(counts)
    total = off[-1]
    if size == 1:
        return Schedule((Step(local=(Copy(IN, 0, OUT, 0, counts[0]),)),), name="ring")
    left, right = ring_neighbours(rank, size)
    steps: list[Step] = [Step(local=(Copy(IN, 0, TMP, 0, total),))]
    for k in range(size - 1):
        s, r = (rank - k - 1) % size, (rank - k - 2) % size
        steps.append(Step(xfers=(Send(right, TMP, off[s], counts[s]),
                                 Recv(left, TMP, off[r], counts[r], reduce=True))))
    steps.append(Step(local=(Copy(TMP, off[rank], OUT, 0, counts[rank]),)))
    return Schedule(tuple(steps), tmp=total, name="ring")
