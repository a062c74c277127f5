"""The schedule vocabulary shared by algorithms, the executor and the simulator.

Buffers are named by index: ``IN`` (the send buffer), ``OUT`` (the receive buffer; the
same memory as IN for in-place operations) and ``TMP`` (scratch the executor allocates,
``Schedule.tmp`` elements). Offsets and counts are in elements.
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


def split_even(count: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``count`` (the first ones one larger)."""
    q, r = divmod(count, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def offsets(counts: list[int] | tuple[int, ...]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
