"""Pairwise-exchange alltoall(v) in the congestion-free order.

At step k = 1..n-1 rank r sends its block for rank r+k and receives rank r-k's block for
it, so every rank sends to and receives from exactly one peer per step (a shift
permutation: no link or port carries two flows in one direction). Own block is copied.
Cost: (n-1) alpha + (n-1)/n S beta.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import IN, OUT, Args, Copy, Counts, Recv, Schedule, Send, Step, offsets


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, send_counts: tuple[int, ...],
             recv_counts: tuple[int, ...]) -> Schedule:
    soff, roff = offsets(send_counts), offsets(recv_counts)
    steps: list[Step] = [Step(local=(Copy(IN, soff[rank], OUT, roff[rank], send_counts[rank]),))]
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        steps.append(Step(xfers=(Send(dst, IN, soff[dst], send_counts[dst]),
                                 Recv(src, OUT, roff[src], recv_counts[src]))))
    return Schedule(tuple(steps), name="pairwise")


def plan(op: str, a: Args) -> Schedule:
    del op  # alltoall and alltoallv alike
    return schedule(a.rank, a.size, a.counts, a.recv_counts)


def counts(op: str, n: int, nbytes: int) -> Counts:
    """n - 1 steps of one message per rank; a rank sends all of its ``nbytes`` but its own
    block, and over all ranks the own blocks add up to one rank's ``nbytes`` (the blocks
    are split evenly, as ``registry.model_args`` does)."""
    del op
    return Counts(n - 1, n * (n - 1), (n - 1) * nbytes)
