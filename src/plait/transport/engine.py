"""The compiled engine's host collective: the direct shared-memory algorithms in C.

``_engine.Board`` (transport/csrc/engine.c) runs a whole operation through the slots
of the host segment: one call from here when every peer arrives within the spin. When a
wait outlasts the spin, the board returns and the slow loop here takes over: it checks
the communicator's health, enforces the deadline (with the same typed errors and
messages as every other wait) and sleeps on this rank's doorbell until the board can go
on.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn, Protocol

from ..errors import PlaitError
from ..reduce import ReduceOp
from . import _engine
from .base import DoneRequest, HostCall, OpCtx, Request

# codes of transport/csrc/engine.c and reduce.h
OPS: dict[str, int] = {
    "allreduce": 0, "reduce": 1, "broadcast": 2, "allgather": 3, "allgatherv": 3,
    "gather": 4, "scatter": 5, "reduce_scatter": 6, "alltoall": 7, "barrier": 8}
DTYPES: dict[str, int] = {
    "float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int8": 4, "uint8": 5,
    "int16": 6, "int32": 7, "int64": 8, "bool": 9}
# AVG is SUM here: the division by the number of ranks follows once (plait.calls)
REDUCE_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PROD: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3,
    ReduceOp.BAND: 4, ReduceOp.BOR: 5, ReduceOp.BXOR: 6}

# how allreduce runs (engine.c MODE_*): by algorithm name
MODES: dict[str, int] = {"direct": 0, "slices": 1, "inplace": 2}

# longest sleep between health checks in a wait (as plait.executor's waits)
MAX_SLEEP_S = 0.05
# after a failed read of a peer's memory, how long the health check gets to name the peer
FAILED_PEER_WAIT_S = 2.0

_DONE = DoneRequest()

# what a pending wait waits for, by the board's stage (engine.c); 2 (arrivals) says no more
_STAGES = {1: " to finish the previous operation", 3: " to reduce their slices",
           4: " to finish reading this rank's buffer"}


class WaitPolicy(Protocol):
    """How the communicator waits: spin budget, whether to yield the core, and the
    health check that raises a peer failure."""

    spin_s: float
    yield_cpu: bool

    def check(self) -> None: ...


def reduce_into(dst: object, src: object, dtype: str, op: ReduceOp) -> None:
    """``dst = dst op src`` element-wise in place (buffers of the dtype's storage)."""
    _engine.reduce(dst, src, DTYPES[dtype], REDUCE_OPS[op])


class EngineHost:
    """The host collective of the direct algorithms over a segment's slots."""

    def __init__(self, mapping: object, n: int, me: int, ctl_offset: int, slots_offset: int,
                 slot_size: int, policy: WaitPolicy, single_copy: bool = True) -> None:
        self.board = _engine.Board(mapping, n, me, ctl_offset, slots_offset, slot_size,
                                   int(policy.spin_s * 1e9), policy.yield_cpu)
        self.check = policy.check
        # PLAIT_CMA_MIN_SIZE=0 turns single copies off: "inplace" then runs as "slices"
        self.modes = dict(MODES) if single_copy else {**MODES, "inplace": MODES["slices"]}

    def supports(self, op: str, algo: str) -> bool:
        return op in OPS and (algo == "direct" or (algo == "inplace" and op != "barrier")
                              or (algo == "slices" and op == "allreduce"))

    def start(self, algo: str, call: HostCall, ctx: OpCtx) -> Request:
        dt = call.dtype
        rop = call.rop
        self.run_codes(OPS[call.op], DTYPES[dt.name] if dt is not None else DTYPES["uint8"],
                       REDUCE_OPS[rop] if rop is not None else 0, call.root, call.send,
                       call.recv, tuple(call.counts), ctx, mode=self.modes[algo])
        return _DONE

    def run_codes(self, op: int, dtype: int, rop: int, root: int, send: Any, recv: Any,
                  counts: tuple[int, ...], ctx: OpCtx, nbytes: int = -1,
                  mode: int = 0) -> None:
        """One operation by its codes (OPS, DTYPES, REDUCE_OPS); buffers as the board
        takes them (any C-contiguous buffer; None where this rank has none; with
        ``nbytes`` >= 0, ``recv`` is the address of that many bytes); ``mode``: how an
        allreduce runs (MODES)."""
        try:
            pending = self.board.run(op, dtype, rop, root, send, recv, counts, nbytes, mode)
        except OSError as exc:
            self.failed(exc, ctx)
        if pending:
            self.wait(ctx)

    def failed(self, exc: OSError, ctx: OpCtx) -> NoReturn:
        """Reading a peer's memory failed (process_vm_readv): that peer has most likely
        died. The health check names it as every other peer failure (it polls liveness
        at its own pace, well within this bound); else the error says where it happened."""
        end = time.monotonic() + FAILED_PEER_WAIT_S
        while time.monotonic() < end:
            self.check()
            time.sleep(0.01)
        raise PlaitError(f"{ctx.where}: {exc}") from exc

    def wait(self, ctx: OpCtx) -> None:
        """The slow path of an operation the board left pending (its run() returned 1):
        health checks, the deadline, sleeps on the doorbell, resumes."""
        board = self.board
        try:
            while True:
                self.check()
                now = time.monotonic()
                if now > ctx.deadline:
                    raise ctx.timeout_error(self.waiting_for())
                if board.sleep(min(MAX_SLEEP_S, max(ctx.deadline - now, 0.001))):
                    try:
                        if not board.resume():
                            return
                    except OSError as exc:
                        self.failed(exc, ctx)
        except BaseException:
            board.abandon()  # the operation failed: let go of its buffers
            raise

    def waiting_for(self) -> str:
        stage, ranks = self.board.waiting()
        return "rank(s) " + ", ".join(str(r) for r in ranks) + _STAGES.get(stage, "")

    def close(self) -> None:
        self.board.close()
