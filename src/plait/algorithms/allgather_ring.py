"""Ring allgather(v).

Semantics: OUT holds every rank's block, rank-major (block i has counts[i] elements).
Rank r first copies its own block into place; then at step k = 0..n-2 it sends block
(r-k) to the right and receives block (r-k-1) from the left. Bytes sent per rank:
S_total - S_r. Cost: (n-1) alpha + (n-1)/n S_total beta (even counts).
"""

from __future__ import annotations

from functools import lru_cache

from .peers import ring_neighbours
from .schedule import IN, OUT, Args, Copy, Counts, Recv, Schedule, Send, Step, offsets


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, counts: tuple[int, ...], in_place: bool = False) -> Schedule:
    off = offsets(counts)
    steps: list[Step] = []
    if not in_place:
        steps.append(Step(local=(Copy(IN, 0, OUT, off[rank], counts[rank]),)))
    left, right = ring_neighbours(rank, size)
    for k in range(size - 1):
        s, r = (rank - k) % size, (rank - k - 1) % size
        steps.append(Step(xfers=(Send(right, OUT, off[s], counts[s]),
                                 Recv(left, OUT, off[r], counts[r]))))
    return Schedule(tuple(steps), name="ring")


def plan(op: str, a: Args) -> Schedule:
    del op  # allgather and allgatherv alike
    return schedule(a.rank, a.size, a.counts)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """n - 1 steps of one message per rank; every block travels to the n - 1 others."""
    del op
    return Counts(n - 1, n * (n - 1), (n - 1) * nbytes)
