"""Pipelined chain broadcast, for large messages.

Ranks form a chain from the root (position p = (r - root) mod n). The buffer is cut into
K pieces; the rank at position p receives piece c at step c + p - 1 and forwards it at
step c + p, so all links are busy at once. Steps: K + n - 2. Cost:
(K + n - 2) (alpha + S/K beta), close to S beta for K >> n.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import OUT, Recv, Schedule, Send, Step, offsets, split_even


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, count: int, root: int, pieces: int) -> Schedule:
    if size == 1:
        return Schedule((), name="chain")
    p = (rank - root) % size
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    k = max(1, min(pieces, count)) if count else 1
    seg = split_even(count, k)
    off = offsets(seg)
    steps = []
    for s in range(k + size - 2):
        xfers: list[Send | Recv] = []
        c_send = s - p
        if p < size - 1 and 0 <= c_send < k:
            xfers.append(Send(nxt, OUT, off[c_send], seg[c_send]))
        c_recv = s - p + 1
        if p > 0 and 0 <= c_recv < k:
            xfers.append(Recv(prev, OUT, off[c_recv], seg[c_recv]))
        steps.append(Step(xfers=tuple(xfers)))
    return Schedule(tuple(steps), name="chain")
