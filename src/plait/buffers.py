"""Turning user buffers (numpy arrays, torch CPU tensors) into flat numpy views.

plait moves bytes between flat views of the caller's memory; no buffer is copied on the
way in. Validation happens here, before any communication, and every error names the
rank, the operation and the argument.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .reduce import DTYPES, DType, dtype_of_numpy


class Buf:
    """A validated buffer: ``arr`` is a flat, contiguous view of the caller's memory."""

    __slots__ = ("arr", "count", "dtype", "nbytes")

    def __init__(self, arr: np.ndarray, dtype: DType) -> None:
        self.arr = arr
        self.dtype = dtype
        self.count = arr.shape[0]
        self.nbytes = arr.nbytes

    def bytes(self) -> np.ndarray:
        """The same memory as uint8."""
        return self.arr.view(np.uint8)


def _err(rank: int, op: str, arg: str, msg: str) -> str:
    return f"rank {rank}, {op}: {arg} {msg}"


def _torch_module() -> Any:
    return sys.modules.get("torch")


def as_buf(obj: Any, *, rank: int, op: str, arg: str, writable: bool = False) -> Buf:
    """Validate ``obj`` and return a flat view; raises TypeError/ValueError on bad input."""
    if isinstance(obj, Buf):  # already validated (plait passing views between its layers)
        return obj
    if isinstance(obj, np.ndarray):
        dt = dtype_of_numpy(obj.dtype)
        if dt is None:
            raise TypeError(_err(rank, op, arg, f"has unsupported dtype {obj.dtype} "
                                 f"(supported: {', '.join(DTYPES)})"))
        if not obj.flags.c_contiguous:
            raise ValueError(_err(rank, op, arg, "is not contiguous; pass a contiguous copy "
                                  "(np.ascontiguousarray) so plait can write into it in place"))
        if writable and not obj.flags.writeable:
            raise ValueError(_err(rank, op, arg, "is read-only but receives data"))
        return Buf(obj.reshape(-1), dt)
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_buf(obj, torch, rank=rank, op=op, arg=arg)
    raise TypeError(_err(rank, op, arg, f"must be a numpy array or a torch CPU tensor, "
                         f"not {type(obj).__name__}"))


# Small tensors are converted to numpy once and the view is reused: tensor.numpy() costs
# ~4 us here, more than a whole shared-memory exchange of a small message. The cached
# view keeps its storage alive, so a hit on (address, count, dtype) is the same memory.
_SMALL_TENSOR = 1 << 16
_CACHE_SIZE = 32
_tensor_cache: dict[tuple[int, int, Any], np.ndarray] = {}
_TORCH_NAMES: dict[Any, str] = {}


def _tensor_buf(t: Any, torch: Any, *, rank: int, op: str, arg: str) -> Buf:
    tdt = t.dtype
    n = t.numel()
    arr = _tensor_cache.get((t.data_ptr(), n, tdt))
    if arr is not None and t.is_cpu and t.is_contiguous() and t.layout == torch.strided:
        return Buf(arr, DTYPES[_TORCH_NAMES[tdt]])
    if t.device.type != "cpu":
        raise ValueError(_err(rank, op, arg, f"is on device {t.device}; plait moves CPU "
                              "tensors only (copy it to the CPU first)"))
    if t.layout != torch.strided:
        raise ValueError(_err(rank, op, arg, f"has layout {t.layout}; only dense tensors"))
    if not t.is_contiguous():
        raise ValueError(_err(rank, op, arg, "is not contiguous; pass t.contiguous()"))
    name = str(tdt).removeprefix("torch.")
    dt = DTYPES.get(name)
    if dt is None:
        raise TypeError(_err(rank, op, arg, f"has unsupported dtype {tdt} "
                             f"(supported: {', '.join(DTYPES)})"))
    if name == "bfloat16":
        arr = t.detach().view(torch.int16).reshape(-1).numpy().view(np.uint16)
    else:
        arr = t.detach().reshape(-1).numpy()
    if n * dt.itemsize <= _SMALL_TENSOR:
        _TORCH_NAMES[tdt] = name
        if len(_tensor_cache) >= _CACHE_SIZE:
            _tensor_cache.pop(next(iter(_tensor_cache)))
        _tensor_cache[(t.data_ptr(), n, tdt)] = arr
    return Buf(arr, dt)


def same_dtype(a: Buf, b: Buf, *, rank: int, op: str) -> None:
    if a.dtype is not b.dtype:
        raise TypeError(f"rank {rank}, {op}: send and receive buffers differ in dtype "
                        f"({a.dtype.name} vs {b.dtype.name})")


def expect_count(b: Buf, count: int, *, rank: int, op: str, arg: str, why: str) -> None:
    if b.count != count:
        raise ValueError(_err(rank, op, arg, f"has {b.count} elements but must have exactly "
                              f"{count} ({why})"))
