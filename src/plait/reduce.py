"""Reduce operations and the element types plait moves.

Buffers travel as raw bytes; a :class:`DType` says how to reduce them. bfloat16 has no
numpy type, so its bytes travel as ``uint16`` and are reduced by torch on views of the
same memory.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class ReduceOp(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def parse(cls, op: Any, *, rank: int = -1, opname: str = "?") -> ReduceOp:
        """Accept a ReduceOp, a name in any case, or a ``torch.distributed.ReduceOp``."""
        if isinstance(op, ReduceOp):
            return op
        fast = _BY_NAME.get(op) if isinstance(op, str) else None
        if fast is not None:
            return fast
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        else:
            name = _torch_op_name(op)
            if name is not None and name in cls.__members__:
                return cls[name]
        raise ValueError(f"rank {rank}, {opname}: unknown reduce op {op!r} "
                         f"(expected one of {', '.join(m.name for m in cls)})")


_BY_NAME: dict[str, ReduceOp] = {
    **{m.value: m for m in ReduceOp}, **{m.name: m for m in ReduceOp}}


def _torch_op_name(op: Any) -> str | None:
    """Name of a torch.distributed.ReduceOp (or its RedOpType) without importing torch."""
    mod = type(op).__module__ or ""
    if "torch" not in mod:
        return None
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name.upper()
    text = str(op)  # e.g. "RedOpType.SUM"
    return text.rsplit(".", 1)[-1].upper()


def _quiet_fp_state() -> tuple[Any, Any] | None:
    """numpy's floating-point error state as a context variable plus the value that
    ignores overflow: setting it directly costs ~0.2 us, np.errstate ~2 us (numpy 2.x;
    None on a numpy without it, which falls back to np.errstate)."""
    try:
        from numpy._core.umath import _extobj_contextvar as cv
    except ImportError:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        quiet = cv.get()
    return cv, quiet


_QUIET = _quiet_fp_state()

Reducer = Callable[[np.ndarray, np.ndarray], None]
"""``reducer(acc, other)``: ``acc = acc (op) other`` in place, both of the storage dtype."""


@dataclass(frozen=True)
class DType:
    name: str
    storage: np.dtype
    kind: str  # "f" floating, "i" integer (signed or not), "b" bool

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def reducer(self, op: ReduceOp, *, rank: int = -1, opname: str = "?") -> Reducer:
        """The in-place reduction for ``op`` on this dtype, or TypeError if undefined."""
        key = (self.name, op)
        fn = _REDUCERS.get(key)
        if fn is None:
            fn = _make_reducer(self, op, rank, opname)
            _REDUCERS[key] = fn
        return fn


_REDUCERS: dict[tuple[str, ReduceOp], Reducer] = {}


def _make_reducer(dt: DType, op: ReduceOp, rank: int, opname: str) -> Reducer:
    bad = f"rank {rank}, {opname}: reduce op {op.name} is not defined for {dt.name}"
    if dt.kind == "b":
        ufunc = {ReduceOp.SUM: np.logical_or, ReduceOp.BOR: np.logical_or,
                 ReduceOp.MAX: np.logical_or, ReduceOp.PROD: np.logical_and,
                 ReduceOp.BAND: np.logical_and, ReduceOp.MIN: np.logical_and,
                 ReduceOp.BXOR: np.logical_xor}.get(op)
        if ufunc is None:
            raise TypeError(bad + " (AVG needs a floating dtype)")
    else:
        if dt.kind == "f" and op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            raise TypeError(bad + " (bitwise ops need an integer or bool dtype)")
        if dt.kind == "i" and op is ReduceOp.AVG:
            raise TypeError(bad + " (AVG needs a floating dtype)")
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
                 ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                 ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                 ReduceOp.BXOR: np.bitwise_xor}[op]
    if dt.name == "bfloat16":
        return _bf16_reducer(op)

    if dt.kind != "f":
        def reduce(acc: np.ndarray, other: np.ndarray, _u: Any = ufunc) -> None:
            _u(acc, other, out=acc)

        return reduce

    if _QUIET is not None:
        cv, quiet = _QUIET

        def reduce_fp(acc: np.ndarray, other: np.ndarray, _u: Any = ufunc) -> None:
            # overflow to inf is a result, as in every other backend, not a warning that
            # -W error would turn into an exception in the caller's allreduce
            token = cv.set(quiet)
            try:
                _u(acc, other, out=acc)
            finally:
                cv.reset(token)

        return reduce_fp

    def reduce_fp_slow(acc: np.ndarray, other: np.ndarray, _u: Any = ufunc) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            _u(acc, other, out=acc)

    return reduce_fp_slow


def _bf16_reducer(op: ReduceOp) -> Reducer:
    import torch

    fn = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul,
          ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}[op]

    def reduce(acc: np.ndarray, other: np.ndarray) -> None:
        a = torch.from_numpy(acc).view(torch.bfloat16)
        b = torch.from_numpy(np.ascontiguousarray(other)).view(torch.bfloat16)
        fn(a, b, out=a)

    return reduce


def divide(buf: np.ndarray, dt: DType, n: int) -> None:
    """AVG's final step: true division by the number of ranks, in place."""
    if dt.name == "bfloat16":
        import torch

        t = torch.from_numpy(buf).view(torch.bfloat16)
        t.div_(n)
    else:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            np.true_divide(buf, n, out=buf)


DTYPES: dict[str, DType] = {
    name: DType(name, np.dtype(storage), kind)
    for name, storage, kind in [
        ("float16", "float16", "f"), ("bfloat16", "uint16", "f"), ("float32", "float32", "f"),
        ("float64", "float64", "f"), ("int8", "int8", "i"), ("uint8", "uint8", "i"),
        ("int16", "int16", "i"), ("int32", "int32", "i"), ("int64", "int64", "i"),
        ("bool", "bool", "b"),
    ]
}

_NP_TO_DTYPE = {DTYPES[n].storage: DTYPES[n] for n in DTYPES if n != "bfloat16"}


def dtype_of_numpy(dt: np.dtype) -> DType | None:
    return _NP_TO_DTYPE.get(dt)
