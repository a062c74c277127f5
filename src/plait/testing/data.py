"""Exact, seeded test data that depends on the rank and on the element index.

Every value is a pure function of ``(dtype, rank, index, seed)``, so each rank can
rebuild every other rank's input and check its own output without any communication,
and a chunk placed at the wrong offset or taken from the wrong rank fails. The patterns
follow nccl-tests ``verifiable``: values whose reductions are exact in any order.

- ``op=None`` (moves: broadcast, gather, alltoall, ...): wide dtypes get values unique
  per (rank, index); narrow ones a pattern that still differs between neighbours.
- SUM/AVG/MIN/MAX on floats: integers in [-30, 30], so any sum over at most 5 ranks is
  exact even in float16 and bfloat16 (|sum| <= 150 < 256).
- PROD on floats: values from {1, 2, -1, -2, 0.5}; products over 5 ranks stay exact.
- integers: values spread over the whole range of the type, so SUM and PROD wrap.
- bool: a hash bit, so OR, AND and XOR over the ranks all give mixed results.

bfloat16 has no numpy type: :func:`values` returns its values as float32 (all exactly
representable in bfloat16), and :func:`make` with ``lib="torch"`` builds the tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
               "int32", "int64", "bool")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64")

SENTINEL = 77
"""Fill value of receive buffers: outside the range of every float pattern."""

_PROD_TABLE = np.array([1.0, 2.0, -1.0, 1.0, -2.0, 0.5, 1.0], dtype=np.float64)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s values (float32 for bfloat16)."""
    return np.dtype("float32" if dtype == "bfloat16" else dtype)


def _op_name(op: Any) -> str | None:
    if op is None:
        return None
    name = getattr(op, "name", op)
    return str(name).rsplit(".", 1)[-1].lower()


def _hash(rank: int, idx: np.ndarray, seed: int) -> np.ndarray:
    """A cheap integer mix of (rank, index, seed) in [0, 2**31), vectorised."""
    x = idx.astype(np.uint64) * np.uint64(2654435761)
    x ^= np.uint64((rank * 0x9E3779B1 + seed * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF)
    x = (x ^ (x >> np.uint64(15))) * np.uint64(0x2C1B3C6D)
    x ^= x >> np.uint64(13)
    return (x & np.uint64(0x7FFFFFFF)).astype(np.int64)


def values(dtype: str, count: int, rank: int, *, op: Any = None, seed: int = 0,
           offset: int = 0) -> np.ndarray:
    """Rank ``rank``'s ``count`` test values (element indices ``offset`` onwards).

    ``op`` (a reduce op or its name, or None for moves) picks a pattern whose reduction
    is exact; see the module docstring.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}")
    idx = np.arange(offset, offset + count, dtype=np.int64)
    name = _op_name(op)
    if dtype == "bool":
        return (_hash(rank, idx, seed) & 1).astype(bool)
    if dtype in FLOAT_DTYPES:
        if name == "prod":
            out = _PROD_TABLE[(rank * 3 + idx * 5 + seed) % len(_PROD_TABLE)]
        elif name is None and dtype in ("float32", "float64"):
            # unique per (rank, index) for index < 65536, exact in float32 (< 2**24)
            out = (rank * 65536 + (idx + seed * 977) % 65536).astype(np.float64)
        else:
            out = ((rank * 131 + idx * 7 + seed * 17) % 61 - 30).astype(np.float64)
        return out.astype(numpy_dtype(dtype))
    # integers: spread over the full range, so sums and products wrap
    bits = np.dtype(dtype).itemsize * 8
    h = (rank * 131 + idx * 7 + seed * 17) % 251 + _hash(rank, idx, seed) % 5
    if name is None and bits >= 32:
        raw = rank * 65536 + (idx + seed * 977) % 65536  # unique per (rank, index)
        return raw.astype(dtype)
    mult = (1 << (bits - 8)) + 12345 if bits > 8 else 1
    wrapped = (h.astype(np.uint64) * np.uint64(mult)) & np.uint64((1 << bits) - 1)
    return wrapped.astype(f"uint{bits}").view(dtype)


def make(dtype: str, count: int, rank: int, *, op: Any = None, seed: int = 0,
         lib: str = "numpy", offset: int = 0) -> Any:
    """:func:`values` as a fresh numpy array (``lib="numpy"``) or torch tensor
    (``lib="torch"``; required for bfloat16)."""
    arr = values(dtype, count, rank, op=op, seed=seed, offset=offset)
    return from_numpy(arr, dtype, lib)


def from_numpy(arr: np.ndarray, dtype: str, lib: str) -> Any:
    """Convert reference values (float32 for bfloat16) into a buffer of ``lib``."""
    if lib == "numpy":
        if dtype == "bfloat16":
            raise ValueError("bfloat16 buffers exist only as torch tensors (lib='torch')")
        return np.array(arr, dtype=np.dtype(dtype), copy=True)
    if lib != "torch":
        raise ValueError(f"unknown lib {lib!r} (numpy or torch)")
    import torch

    t = torch.from_numpy(np.array(arr, copy=True))
    if dtype == "bfloat16":
        t = t.to(torch.bfloat16)
    return t


def empty(dtype: str, count: int, *, lib: str = "numpy", fill: Any = SENTINEL) -> Any:
    """A receive buffer of ``count`` elements prefilled with a sentinel."""
    if dtype == "bool":
        arr = np.full(count, bool(fill), dtype=bool)
    elif dtype in INT_DTYPES:
        arr = np.full(count, fill, dtype=np.int64).astype(dtype)
    else:
        arr = np.full(count, fill, dtype=numpy_dtype(dtype))
    return from_numpy(arr, dtype, lib)


def to_numpy(buf: Any) -> np.ndarray:
    """A flat numpy copy of a buffer (bfloat16 tensors become float32)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).copy()
    import torch

    if isinstance(buf, torch.Tensor):
        t = buf.detach().reshape(-1)
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy().copy()
    raise TypeError(f"not a buffer: {type(buf).__name__}")


def dtype_name(buf: Any) -> str:
    """plait's name of a buffer's dtype ("float32", "bfloat16", ...)."""
    if isinstance(buf, np.ndarray):
        return str(buf.dtype)
    return str(buf.dtype).removeprefix("torch.")


def assert_equal(actual: Any, expected: Any, what: str = "") -> None:
    """Exact comparison of a buffer with reference values; the message names the first
    wrong element and the numbers of wrong elements."""
    a = to_numpy(actual)
    e = to_numpy(expected) if not isinstance(expected, np.ndarray) else expected.reshape(-1)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: {a.shape[0]} elements, expected {e.shape[0]}")
    if a.dtype.kind == "f" or e.dtype.kind == "f":
        bad = ~((a == e) | (np.isnan(a.astype(np.float64)) & np.isnan(e.astype(np.float64))))
    else:
        bad = a != e
    if bad.any():
        wrong = np.flatnonzero(bad)
        i = int(wrong[0])
        lo, hi = max(i - 2, 0), min(i + 3, a.shape[0])
        raise AssertionError(
            f"{what}: {wrong.size} of {a.shape[0]} elements wrong; first at index {i}: "
            f"got {a[i]!r}, expected {e[i]!r}; around it got {a[lo:hi].tolist()}, "
            f"expected {e[lo:hi].tolist()}")
