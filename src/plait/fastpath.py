"""The synchronous small allreduce on numpy arrays, from the method call to the engine.

A latency-bound caller (tensor-parallel decode: about a hundred small allreduces per
token) pays for every Python step between ``comm.allreduce(buf)`` and the compiled
engine. This path keeps only what cannot be cached: the buffer's type, contiguity and
size, one dict lookup for (dtype, op), the sequence number and flight-recorder slot
(plait.progress), and the engine call. What it does not handle (torch tensors go through
plait.calls, other sizes, async, a busy or broken communicator, bad arguments) returns
False, and the general path takes the call — and raises its errors with their messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .buffers import Buf
from .calls import Calls
from .progress import Sequencer
from .reduce import DType, ReduceOp, divide, dtype_of_numpy
from .transport import engine
from .transport.base import OpCtx

_ALLREDUCE = engine.OPS["allreduce"]


class FastPath:
    def __init__(self, seq: Sequencer, host: engine.EngineHost, calls: Calls, size: int,
                 direct: Callable[[int], bool]) -> None:
        self._seq = seq
        self._host = host
        self._calls = calls
        self._size = size
        self._direct = direct  # whether selection picks the engine for this many bytes
        self._sizes: dict[int, bool] = {}
        # (numpy dtype, op as passed) -> (dtype code, op code, plait dtype, divide after)
        self._ops: dict[tuple[np.dtype, Any], tuple[int, int, DType, bool]] = {}

    @classmethod
    def make(cls, seq: Sequencer, host: object, calls: Calls, size: int,
             direct: Callable[[int], bool]) -> FastPath | None:
        """The fast path where the host collective is the engine, else None."""
        if not isinstance(host, engine.EngineHost):
            return None
        return cls(seq, host, calls, size, direct)

    def allreduce(self, buf: Any, op: Any) -> bool:
        """Run ``allreduce(buf, op)`` and return True, or return False having done
        nothing."""
        if type(buf) is not np.ndarray:
            return False
        try:
            ent = self._ops.get((buf.dtype, op))
        except TypeError:  # an unhashable op object
            return False
        if ent is None:
            ent = self._learn(buf, op)
            if ent is None:
                return False
        nbytes = buf.nbytes
        ok = self._sizes.get(nbytes)
        if ok is None:
            ok = self._sizes[nbytes] = self._direct(nbytes)
            if len(self._sizes) > 4096:
                self._sizes.clear()
        flags = buf.flags
        if not (ok and flags.c_contiguous and flags.writeable):
            return False
        dt, code, dtype, avg = ent
        run = self._host.run_codes

        def fn(ctx: OpCtx) -> None:
            run(_ALLREDUCE, dt, code, 0, None, buf, (), ctx)

        if not self._seq.run_inline("allreduce", fn, nbytes, dtype, "direct"):
            return False
        if avg:
            divide(buf, dtype, self._size)
        return True

    def _learn(self, buf: np.ndarray, op: Any) -> tuple[int, int, DType, bool] | None:
        dtype = dtype_of_numpy(buf.dtype)
        if dtype is None:
            return None
        try:
            rop, _ = self._calls.reducer(op, Buf(buf.reshape(-1), dtype), "allreduce")
        except (TypeError, ValueError):
            return None  # the general path raises it with its message
        ent = (engine.DTYPES[dtype.name], engine.REDUCE_OPS[rop], dtype, rop is ReduceOp.AVG)
        if len(self._ops) > 256:
            self._ops.clear()
        self._ops[(buf.dtype, op)] = ent
        return ent
