"""The schedule vocabulary shared by algorithms, the executor and the simulator.

Buffers are named by index: ``IN`` (the send buffer), ``OUT`` (the receive buffer; the
same memory as IN for in-place operations) and ``TMP`` (scratch the executor allocates,
``Schedule.tmp`` elements). Offsets and counts are in elements.

``Args`` (what an algorithm plans from) and ``Counts`` (its closed-form traffic) belong to
the algorithm registry's API (``plait.algorithms.registry`` re-exports them); they are
defined here so that the algorithm modules, which the registry imports, need not import
the registry back.
"""

from __future__ import annotations

from dataclasses import dataclass

IN, OUT, TMP = 0, 1, 2


@dataclass(frozen=True)
class Send:
    peer: int
    buf: int
    off: int
    count: int


@dataclass(frozen=True)
class Recv:
    """Receive into ``buf[off:off+count]``; with ``reduce`` combine into what is there."""

    peer: int
    buf: int
    off: int
    count: int
    reduce: bool = False


@dataclass(frozen=True)
class Copy:
    src: int
    src_off: int
    dst: int
    dst_off: int
    count: int


@dataclass(frozen=True)
class Reduce:
    """``dst[dst_off:+count] = dst (op) src[src_off:+count]``."""

    src: int
    src_off: int
    dst: int
    dst_off: int
    count: int


@dataclass(frozen=True)
class Step:
    local: tuple[Copy | Reduce, ...] = ()
    xfers: tuple[Send | Recv, ...] = ()


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    tmp: int = 0
    name: str = ""


@dataclass(frozen=True)
class Args:
    """Planning input of one rank, counts in elements.

    ``counts``: allreduce/reduce/broadcast ``(count,)``; allgather(v) every rank's count;
    reduce_scatter(v) every rank's block count; alltoall(v) the send counts; gather and
    scatter ``(count per rank,)``; barrier ``()``. ``recv_counts``: alltoall(v) only.
    ``itemsize``: bytes per element (the chain broadcast sizes its pieces in bytes).
    ``order``: the ring order from the topology (empty: identity), which the ring
    allreduce follows.
    """

    rank: int
    size: int
    counts: tuple[int, ...] = ()
    recv_counts: tuple[int, ...] = ()
    root: int = 0
    itemsize: int = 1
    order: tuple[int, ...] = ()


@dataclass(frozen=True)
class Counts:
    """Closed-form traffic of one operation, summed over all ranks.

    ``steps``: the most steps with a transfer (Send or Recv) in any one rank's schedule,
    i.e. that rank's latency term (a pipeline's overall length can be longer: the chain
    broadcast's K + n - 2). ``messages``: Send transfers of all ranks, zero-byte ones
    included. ``bytes``: bytes sent by all ranks.
    """

    steps: int
    messages: int
    bytes: int


def relabel(sched: Schedule, order: tuple[int, ...]) -> Schedule:
    """A schedule written for ring positions, with peers renamed to ranks: position p is
    rank ``order[p]``."""
    steps = []
    for st in sched.steps:
        xf: list[Send | Recv] = []
        for x in st.xfers:
            if isinstance(x, Send):
                xf.append(Send(order[x.peer], x.buf, x.off, x.count))
            else:
                xf.append(Recv(order[x.peer], x.buf, x.off, x.count, x.reduce))
        steps.append(Step(st.local, tuple(xf)))
    return Schedule(tuple(steps), sched.tmp, sched.name)


def ceil_log2(n: int) -> int:
    """Rounds of an algorithm that doubles its reach each round (0 for n <= 1)."""
    return (n - 1).bit_length() if n > 1 else 0


def split_even(count: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``count`` (the first ones one larger)."""
    q, r = divmod(count, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def offsets(counts: list[int] | tuple[int, ...]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
