"""Recursive-doubling allreduce, for small messages (latency-bound, any world size).

Semantics: in place on OUT (= IN). With p the largest power of two <= n and rem = n - p:
the first 2*rem ranks pair up, the even one sends its data to the odd one and sits out;
the p remaining ranks exchange whole buffers with partners at distance 1, 2, 4, ... and
reduce (into TMP first: a buffer cannot be sent and reduced into at once); finally each
odd rank sends the result back to its even partner. Every rank reduces in an order that
differs only by commutation, so results are identical on every rank. Bytes sent per rank:
log2(p) * S (+ S for the pairing). Cost: (log2 p + 2[rem>0]) (alpha + S beta).
"""

from __future__ import annotations

from functools import lru_cache

from .peers import rd_layout, rd_newrank, rd_oldrank
from .schedule import OUT, TMP, Args, Counts, Recv, Reduce, Schedule, Send, Step


@lru_cache(maxsize=256)
def schedule(rank: int, size: int, count: int) -> Schedule:
    if size == 1:
        return Schedule((), name="rd")
    p, rem = rd_layout(size)
    steps: list[Step] = []
    if rank < 2 * rem:
        if rank % 2 == 0:
            steps.append(Step(xfers=(Send(rank + 1, OUT, 0, count),)))
        else:
            steps.append(Step(xfers=(Recv(rank - 1, TMP, 0, count),)))
            steps.append(Step(local=(Reduce(TMP, 0, OUT, 0, count),)))
    new = rd_newrank(rank, rem)
    if new is not None:
        mask = 1
        while mask < p:
            partner = rd_oldrank(new ^ mask, rem)
            steps.append(Step(xfers=(Send(partner, OUT, 0, count), Recv(partner, TMP, 0, count))))
            steps.append(Step(local=(Reduce(TMP, 0, OUT, 0, count),)))
            mask <<= 1
    if rank < 2 * rem:
        if rank % 2 == 0:
            steps.append(Step(xfers=(Recv(rank + 1, OUT, 0, count),)))
        else:
            steps.append(Step(xfers=(Send(rank - 1, OUT, 0, count),)))
    return Schedule(tuple(steps), tmp=count, name="rd")


def plan(op: str, a: Args) -> Schedule:
    del op  # allreduce only
    return schedule(a.rank, a.size, a.counts[0])


def counts(op: str, n: int, nbytes: int) -> Counts:
    """log2 p exchange steps for the p participants (p sends each), and, when n is not a
    power of two, the pairing and the result sent back (rem messages each way): the odd
    rank of a pair is busy log2 p + 2 steps. Every message carries the whole buffer."""
    del op
    if n == 1:
        return Counts(0, 0, 0)
    p, rem = rd_layout(n)
    rounds = p.bit_length() - 1
    messages = p * rounds + 2 * rem
    return Counts(rounds + (2 if rem else 0), messages, messages * nbytes)
