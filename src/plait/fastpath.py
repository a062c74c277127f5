"""The synchronous small allreduce on numpy arrays and torch tensors, straight to the
engine.

A latency-bound caller (tensor-parallel decode: about a hundred small allreduces per
token) pays for every Python step between ``comm.allreduce(buf)`` and the compiled
engine. This path keeps only what cannot be cached: the buffer's type, contiguity and
size, one dict lookup for (dtype, op), the sequence number and flight-recorder slot
(plait.progress), and the engine call. What it does not handle (tensor subclasses, other
devices, other sizes, async, a busy or broken communicator, bad arguments) returns False
having done nothing, and the general path (plait.calls) takes the call — and raises its
errors with their messages.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .buffers import as_buf
from .calls import Calls
from .progress import Sequencer
from .reduce import DType, ReduceOp, divide
from .transport import engine
from .transport.base import OpCtx

_ALLREDUCE = engine.OPS["allreduce"]


class FastPath:
    def __init__(self, seq: Sequencer, host: engine.EngineHost, calls: Calls, size: int,
                 choose: Callable[[int], str]) -> None:
        self._seq = seq
        self._host = host
        self._calls = calls
        self._size = size
        self._choose = choose  # the algorithm selection picks for this many bytes
        self._sizes: dict[int, tuple[str, int | None]] = {}  # (algorithm, engine mode)
        # (numpy dtype, op as passed) -> (dtype code, op code, plait dtype, divide after)
        self._ops: dict[tuple[Any, Any], tuple[int, int, DType, bool]] = {}
        self._tensor: type | None = None
        self._strided: Any = None

    @classmethod
    def make(cls, seq: Sequencer, host: object, calls: Calls, size: int,
             choose: Callable[[int], str]) -> FastPath | None:
        """The fast path where the host collective is the engine, else None."""
        if not isinstance(host, engine.EngineHost):
            return None
        return cls(seq, host, calls, size, choose)

    def allreduce(self, buf: Any, op: Any) -> bool:
        """Run ``allreduce(buf, op)`` and return True, or return False having done
        nothing."""
        kind = type(buf)
        if kind is np.ndarray:
            flags = buf.flags
            if not (flags.c_contiguous and flags.writeable):
                return False
            at: Any = buf
            nbytes = buf.nbytes
        elif kind is self._tensor or (self._tensor is None and self._is_tensor(kind)):
            if not (buf.is_cpu and buf.layout is self._strided and buf.is_contiguous()):
                return False
            at = buf.data_ptr()
            nbytes = buf.nbytes
        else:
            return False
        try:
            ent = self._ops.get((buf.dtype, op))
        except TypeError:  # an unhashable op object
            return False
        if ent is None:
            ent = self._learn(buf, op)
            if ent is None:
                return False
        how = self._sizes.get(nbytes)
        if how is None:
            algo = self._choose(nbytes)
            how = self._sizes[nbytes] = (algo, self._host.modes.get(algo))
            if len(self._sizes) > 4096:
                self._sizes.clear()
        algo, mode = how
        if mode is None:
            return False
        dt, code, dtype, avg = ent
        host = self._host
        run = host.board.run
        # a tensor exports no buffer: its address, kept valid by ``buf`` in this frame
        length = -1 if at is buf else nbytes

        def fn(ctx: OpCtx) -> None:
            try:
                pending = run(_ALLREDUCE, dt, code, 0, None, at, (), length, mode)
            except OSError as exc:
                host.failed(exc, ctx)
            if pending:
                host.wait(ctx)

        if not self._seq.run_inline("allreduce", fn, nbytes, dtype, algo):
            return False
        if avg:
            if at is buf:
                divide(buf, dtype, self._size)
            else:
                buf.div_(self._size)
        return True

    def _is_tensor(self, kind: type) -> bool:
        """Whether ``kind`` is torch.Tensor (looked up once torch is imported: plait does
        not import torch for numpy users)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        self._tensor = torch.Tensor
        self._strided = torch.strided
        return kind is torch.Tensor

    def _learn(self, buf: Any, op: Any) -> tuple[int, int, DType, bool] | None:
        try:
            b = as_buf(buf, rank=self._calls.rank, op="allreduce", arg="buf", writable=True)
            rop, _ = self._calls.reducer(op, b, "allreduce")
        except (TypeError, ValueError):
            return None  # the general path raises it with its message
        dt = b.dtype
        ent = (engine.DTYPES[dt.name], engine.REDUCE_OPS[rop], dt, rop is ReduceOp.AVG)
        if len(self._ops) > 256:
            self._ops.clear()
        self._ops[(buf.dtype, op)] = ent
        return ent
