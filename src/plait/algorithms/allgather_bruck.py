"""Bruck allgather(v), for small messages: ceil(log2 n) steps for any n.

TMP holds blocks in rotated order (TMP block i = rank (r+i)'s block). Rank r starts with
its own block; at step k = 1, 2, 4, ... it sends its first min(k, n-k) blocks to rank r-k
and receives min(k, n-k) blocks from rank r+k, appended. Finally the blocks are rotated
into rank-major order in OUT. Cost: ceil(log2 n) alpha + (n-1)/n S_total beta + copies.
"""

from __future__ import annotations

from functools import lru_cache

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
    ceil_log2,
    offsets,
)


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, counts: tuple[int, ...]) -> Schedule:
    rot = [counts[(rank + i) % size] for i in range(size)]
    roff = offsets(rot)
    off = offsets(counts)
    steps: list[Step] = [Step(local=(Copy(IN, 0, TMP, 0, counts[rank]),))]
    k = 1
    while k < size:
        m = min(k, size - k)
        # blocks rank+k .. rank+k+m-1 arrive into TMP positions k .. k+m-1
        nrecv = roff[k + m] - roff[k]
        nsend = roff[m]
        steps.append(Step(xfers=(Send((rank - k) % size, TMP, 0, nsend),
                                 Recv((rank + k) % size, TMP, roff[k], nrecv))))
        k <<= 1
    copies = tuple(Copy(TMP, roff[i], OUT, off[(rank + i) % size], rot[i]) for i in range(size))
    steps.append(Step(local=copies))
    return Schedule(tuple(steps), tmp=roff[size], name="bruck")


def plan(op: str, a: Args) -> Schedule:
    del op  # allgather and allgatherv alike
    return schedule(a.rank, a.size, a.counts)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """ceil(log2 n) steps of one message per rank. Over all ranks, step k sends every
    block min(k, n-k) times, and those multiplicities add up to n - 1: every block reaches
    the n - 1 others once."""
    del op
    steps = ceil_log2(n)
    return Counts(steps, n * steps, (n - 1) * nbytes)
