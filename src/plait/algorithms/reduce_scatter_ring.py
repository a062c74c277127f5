"""Ring reduce-scatter.

Semantics: IN holds n blocks (block i has counts[i] elements); rank r receives the
reduction of every rank's block r in OUT. IN is left unchanged. At step k = 0..n-2 rank r
sends block (r-k-1) — its own input at step 0, then the partial sum it completed in the
step before — to the right, and receives block (r-k-2) from the left, reducing it into a
copy of its own input block (in TMP, or in OUT for the last step, whose block is r).
Only the n-1 blocks that receive partial sums are copied out of IN.
Cost: (n-1) alpha + (n-1)/n S beta + (n-1)/n S gamma.
"""

from __future__ import annotations

from functools import lru_cache

from .peers import ring_neighbours
from .schedule import (
    IN,
    OUT,
    TMP,
    Args,
    Copy,
    Counts,
    Recv,
    Schedule,
    Send,
    Step,
    offsets,
)


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, counts: tuple[int, ...]) -> Schedule:
    off = offsets(counts)
    if size == 1:
        return Schedule((Step(local=(Copy(IN, 0, OUT, 0, counts[0]),)),), name="ring")
    left, right = ring_neighbours(rank, size)
    steps: list[Step] = []
    for k in range(size - 1):
        s, t = (rank - k - 1) % size, (rank - k - 2) % size
        last = k == size - 2  # then t == rank
        src_buf = IN if k == 0 else TMP
        dst_buf, dst_off = (OUT, 0) if last else (TMP, off[t])
        steps.append(Step(local=(Copy(IN, off[t], dst_buf, dst_off, counts[t]),),
                          xfers=(Send(right, src_buf, off[s], counts[s]),
                                 Recv(left, dst_buf, dst_off, counts[t], reduce=True))))
    return Schedule(tuple(steps), tmp=off[-1], name="ring")


def plan(op: str, a: Args) -> Schedule:
    del op  # reduce_scatter and reduce_scatterv (uneven blocks) alike
    return schedule(a.rank, a.size, a.counts)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """n - 1 steps of one message per rank; each step sends every block once (``nbytes``
    is the whole input of one rank: the n blocks)."""
    del op
    return Counts(n - 1, n * (n - 1), (n - 1) * nbytes)
