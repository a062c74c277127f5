"""Pipelined chain broadcast, for large messages.

Ranks form a chain from the root (position p = (r - root) mod n). The buffer is cut into
K pieces; the rank at position p receives piece c at step c + p - 1 and forwards it at
step c + p, so all links are busy at once. Steps: K + n - 2. Cost:
(K + n - 2) (alpha + S/K beta), close to S beta for K >> n.

K (``pieces``): every piece costs a step, a round trip, so pieces are large: at least
1 MiB, and at most 64 of them; two ranks have nothing to pipeline and send one message.
The executor and the cost model both plan through ``plan``, so both use this K.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import OUT, Args, Counts, Recv, Schedule, Send, Step, offsets, split_even


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


def pieces(size: int, nbytes: int) -> int:
    """K for a broadcast of ``nbytes`` over ``size`` ranks (see the module docstring)."""
    piece = max(1 << 20, nbytes // 64)
    return 1 if size == 2 else max(1, nbytes // piece)


def plan(op: str, a: Args) -> Schedule:
    del op  # broadcast only
    count = a.counts[0]
    return schedule(a.rank, a.size, count, a.root, pieces(a.size, count * a.itemsize))


def counts(op: str, n: int, nbytes: int) -> Counts:
    """Every rank but the last forwards all K pieces, so (n-1) K messages and (n-1) S
    bytes; a rank inside the chain is busy K + 1 steps (it receives piece c while it sends
    piece c-1), the two ends K steps."""
    del op
    if n == 1:
        return Counts(0, 0, 0)
    k = max(1, min(pieces(n, nbytes), nbytes)) if nbytes else 1  # as ``schedule`` clamps
    return Counts(k + 1 if n > 2 else k, (n - 1) * k, (n - 1) * nbytes)
