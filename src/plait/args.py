"""Argument checks shared by the public API (plait.comm) and the PLAIT_DEBUG=check
wrapper (plait.check): errors name this rank, the operation and the problem."""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_TAG = 2**31


def check_rank(r: Any, size: int, rank: int, op: str, what: str) -> int:
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < size:
        raise ValueError(f"rank {rank}, {op}: {what} {r!r} is not a rank of this "
                         f"communicator (0..{size - 1})")
    return int(r)


def check_tag(tag: Any, rank: int, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) \
            or not 0 <= tag < MAX_TAG:
        raise ValueError(f"rank {rank}, {op}: tag {tag!r} must be an int in [0, 2**31)")
    return int(tag)


def check_counts(counts: Any, size: int, rank: int, op: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(c) for c in counts)
    except (TypeError, ValueError):
        raise TypeError(f"rank {rank}, {op}: {what} must be a sequence of integers") \
            from None
    if len(out) != size:
        raise ValueError(f"rank {rank}, {op}: {what} has {len(out)} entries, expected "
                         f"one per rank ({size})")
    if any(c < 0 for c in out):
        raise ValueError(f"rank {rank}, {op}: {what} has a negative count")
    return out


def check_split(color: Any, key: Any, rank: int) -> None:
    if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                              or color < 0):
        raise ValueError(f"rank {rank}, split: color must be a non-negative int or None, "
                         f"not {color!r}")
    if isinstance(key, bool) or not isinstance(key, int):
        raise ValueError(f"rank {rank}, split: key must be an int, not {key!r}")
