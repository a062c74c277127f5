"""The oracle: every collective over lists of per-rank numpy arrays, in one process.

``inputs[r]`` is rank r's (flat) send buffer; each function returns the list of what
every rank must hold afterwards. Reductions are computed independently of plait's own
reduce code: floats in float64 and rounded once to the dtype (exact for the data of
:mod:`plait.testing.data`), integers in int64 and truncated to the dtype (two's
complement wrap-around, as plait defines it), bool with logical operations.

bfloat16 values travel as float32 arrays here; pass ``dtype="bfloat16"`` so results are
rounded to bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")


def op_name(op: Any) -> str:
    """Normalise a reduce op (plait.ReduceOp, torch ReduceOp, any-case string)."""
    name = getattr(op, "name", None)
    text = name if isinstance(name, str) else str(op)
    text = text.rsplit(".", 1)[-1].lower()
    if text not in OPS:
        raise ValueError(f"unknown reduce op {op!r}")
    return text


def _dtype_of(arrays: Sequence[np.ndarray], dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    if not arrays:
        raise ValueError("no arrays and no dtype")
    return str(np.asarray(arrays[0]).dtype)


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` (bfloat16 through torch, returned as float32)."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(x.astype(np.float64)).to(torch.bfloat16).float().numpy()
    return x.astype(dtype)


def check_op(op: Any, dtype: str) -> str:
    """The op's name, or the TypeError plait raises for an undefined (dtype, op) pair."""
    name = op_name(op)
    kind = "b" if dtype == "bool" else "f" if dtype in (
        "float16", "bfloat16", "float32", "float64") else "i"
    if kind == "f" and name in BITWISE:
        raise TypeError(f"reduce op {name.upper()} is not defined for {dtype}")
    if kind != "f" and name == "avg":
        raise TypeError(f"reduce op AVG is not defined for {dtype}")
    return name


def reduce_arrays(arrays: Sequence[np.ndarray], op: Any = "sum",
                  dtype: str | None = None) -> np.ndarray:
    """Elementwise reduction of equally long arrays under plait's rules for ``dtype``."""
    dt = _dtype_of(arrays, dtype)
    name = check_op(op, dt)
    if not arrays:
        raise ValueError("nothing to reduce")
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    n = flat[0].shape[0]
    if any(a.shape[0] != n for a in flat):
        raise ValueError("arrays differ in length")
    if dt == "bool":
        stack = np.stack([a.astype(bool) for a in flat])
        if name in ("sum", "bor", "max"):
            return stack.any(axis=0)
        if name in ("prod", "band", "min"):
            return stack.all(axis=0)
        return (stack.sum(axis=0) % 2).astype(bool)  # bxor
    if dt in ("float16", "bfloat16", "float32", "float64"):
        stack = np.stack([a.astype(np.float64) for a in flat])
        result = {"sum": lambda s: s.sum(axis=0), "avg": lambda s: s.sum(axis=0),
                  "prod": lambda s: s.prod(axis=0), "min": lambda s: s.min(axis=0),
                  "max": lambda s: s.max(axis=0)}[name](stack)
        if name == "avg":
            # plait sums in the dtype, then divides in the dtype: round the sum first
            result = _round(result, dt).astype(np.float64) / len(flat)
        return _round(result, dt)
    # integers: int64 arithmetic wraps modulo 2**64; truncating to the dtype then gives
    # the wrap-around result modulo 2**bits (two's complement).
    stack = np.stack([a.astype(np.int64) for a in flat])
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[name]
    acc = stack[0].copy()
    for row in stack[1:]:
        ufunc(acc, row, out=acc)
    return acc.astype(dt)


def _copies(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a).reshape(-1).copy() for a in inputs]


def allreduce(inputs: Sequence[np.ndarray], op: Any = "sum",
              dtype: str | None = None) -> list[np.ndarray]:
    result = reduce_arrays(inputs, op, dtype)
    return [result.copy() for _ in inputs]


def reduce(inputs: Sequence[np.ndarray], root: int, op: Any = "sum",
           dtype: str | None = None) -> list[np.ndarray]:
    """The root holds the reduction; every other rank's buffer is unchanged."""
    out = _copies(inputs)
    out[root] = reduce_arrays(inputs, op, dtype)
    return out


def broadcast(inputs: Sequence[np.ndarray], root: int) -> list[np.ndarray]:
    return [np.asarray(inputs[root]).reshape(-1).copy() for _ in inputs]


def allgather(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Rank-major concatenation on every rank."""
    whole = np.concatenate([np.asarray(a).reshape(-1) for a in inputs])
    return [whole.copy() for _ in inputs]


def allgatherv(inputs: Sequence[np.ndarray], counts: Sequence[int] | None = None,
               ) -> list[np.ndarray]:
    """As :func:`allgather` with per-rank counts (``inputs[r]`` has ``counts[r]``)."""
    if counts is not None and [np.asarray(a).size for a in inputs] != list(counts):
        raise ValueError("inputs do not match counts")
    return allgather(inputs)


def gather(inputs: Sequence[np.ndarray], root: int) -> list[np.ndarray | None]:
    """The root holds the rank-major concatenation; other ranks receive nothing."""
    whole = np.concatenate([np.asarray(a).reshape(-1) for a in inputs])
    return [whole if r == root else None for r in range(len(inputs))]


def scatter(sendbuf: np.ndarray, size: int) -> list[np.ndarray]:
    """Rank r receives the r-th of ``size`` equal parts of the root's ``sendbuf``."""
    flat = np.asarray(sendbuf).reshape(-1)
    if flat.size % size:
        raise ValueError("sendbuf is not a multiple of size")
    n = flat.size // size
    return [flat[r * n:(r + 1) * n].copy() for r in range(size)]


def reduce_scatter(inputs: Sequence[np.ndarray], op: Any = "sum",
                   dtype: str | None = None) -> list[np.ndarray]:
    """Rank r holds the r-th part of the reduction of every rank's ``size`` parts."""
    return scatter(reduce_arrays(inputs, op, dtype), len(inputs))


def alltoall(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Rank d receives part d of every rank's sendbuf, in rank order."""
    size = len(inputs)
    parts = [scatter(a, size) for a in inputs]
    return [np.concatenate([parts[s][d] for s in range(size)]) for d in range(size)]


def alltoallv(inputs: Sequence[np.ndarray], send_counts: Sequence[Sequence[int]],
              ) -> tuple[list[np.ndarray], list[list[int]]]:
    """``send_counts[s][d]`` elements go from rank s to rank d (consecutive parts of s's
    sendbuf in d order). Returns every rank's receive buffer and its recv_counts."""
    size = len(inputs)
    parts: list[list[np.ndarray]] = []
    for s in range(size):
        flat = np.asarray(inputs[s]).reshape(-1)
        if len(send_counts[s]) != size or sum(send_counts[s]) != flat.size:
            raise ValueError(f"send_counts[{s}] does not match rank {s}'s sendbuf")
        offs = np.cumsum([0, *send_counts[s]])
        parts.append([flat[offs[d]:offs[d + 1]] for d in range(size)])
    outs = [np.concatenate([parts[s][d] for s in range(size)]) for d in range(size)]
    recv_counts = [[int(send_counts[s][d]) for s in range(size)] for d in range(size)]
    return outs, recv_counts
