"""Ring allreduce: a reduce-scatter ring followed by an allgather ring.

Semantics: in place on OUT (= IN). Steps (n ranks, buffer cut into n segments):
reduce-scatter, k = 0..n-2: send segment (r-k) to the right, receive segment (r-k-1) from
the left and reduce it in; rank r then holds the full reduction of segment (r+1). Allgather,
k = 0..n-2: send segment (r+1-k) to the right, receive segment (r-k) from the left.
Bytes sent per rank: 2 (n-1)/n * S. Cost: 2 (n-1) alpha + 2 (n-1)/n * S * beta
(+ (n-1)/n * S * gamma for the reductions).
"""

from __future__ import annotations

from functools import lru_cache

from .peers import ring_neighbours
from .schedule import OUT, Recv, Schedule, Send, Step, offsets, split_even


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
