"""Ring allreduce: a reduce-scatter ring followed by an allgather ring.

Semantics: in place on OUT (= IN). Steps (n ranks, buffer cut into n segments):
reduce-scatter, k = 0..n-2: send segment (r-k) to the right, receive segment (r-k-1) from
the left and reduce it in; rank r then holds the full reduction of segment (r+1). Allgather,
k = 0..n-2: send segment (r+1-k) to the right, receive segment (r-k) from the left.
Bytes sent per rank: 2 (n-1)/n * S. Cost: 2 (n-1) alpha + 2 (n-1)/n * S * beta
(+ (n-1)/n * S * gamma for the reductions).

The ring may run through any order of the ranks (``in_order``): the communicator passes
the topology's ring order (topology/order.py), so that the ranks of a host, and the hosts
of a switch, are neighbours and each network link carries one flow per direction.
"""

from __future__ import annotations

from functools import lru_cache

from .peers import ring_neighbours
from .schedule import OUT, Args, Counts, Recv, Schedule, Send, Step, offsets, relabel, split_even


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, count: int) -> Schedule:
    if size == 1:
        return Schedule((), name="ring")
    left, right = ring_neighbours(rank, size)
    seg = split_even(count, size)
    off = offsets(seg)
    steps = []
    for k in range(size - 1):
        s, r = (rank - k) % size, (rank - k - 1) % size
        steps.append(Step(xfers=(Send(right, OUT, off[s], seg[s]),
                                 Recv(left, OUT, off[r], seg[r], reduce=True))))
    for k in range(size - 1):
        s, r = (rank + 1 - k) % size, (rank - k) % size
        steps.append(Step(xfers=(Send(right, OUT, off[s], seg[s]),
                                 Recv(left, OUT, off[r], seg[r]))))
    return Schedule(tuple(steps), name="ring")


@lru_cache(maxsize=256)
def in_order(rank: int, size: int, count: int, order: tuple[int, ...]) -> Schedule:
    """The ring allreduce of ``rank`` with the ring running through ``order`` (position p
    is rank ``order[p]``)."""
    return relabel(schedule(order.index(rank), size, count), order)


def plan(op: str, a: Args) -> Schedule:
    del op  # allreduce only
    if a.order and a.order != tuple(range(a.size)):
        return in_order(a.rank, a.size, a.counts[0], a.order)
    return schedule(a.rank, a.size, a.counts[0])


def counts(op: str, n: int, nbytes: int) -> Counts:
    """2 (n-1) steps of one message per rank; each step moves every segment once."""
    del op
    if n == 1:
        return Counts(0, 0, 0)
    return Counts(2 * (n - 1), 2 * n * (n - 1), 2 * (n - 1) * nbytes)
