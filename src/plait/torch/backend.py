"""The ``plait`` torch.distributed backend: a ``dist.ProcessGroup`` subclass over plait.

How a ``torch.distributed`` call reaches plait (torch 2.13; ../shared/TORCH_NOTES.md):
``dist.all_reduce`` calls ``group.allreduce([tensor], opts)`` on this object, then calls
``.wait()`` on the result unless ``async_op=True``. ``opts.asyncOp`` tells which, so a
synchronous call runs the plait operation inline on the caller's thread (plait's fast
path for an idle communicator) and returns a shared, already completed Work: no future,
no callback, no thread hand-off. Asynchronous calls (and every call from C++: DDP's
reducer, functional collectives, DTensor) start a plait async operation and return a
:class:`PlaitWork` whose future completes from plait's completion callback.

List-of-tensor operations (all_gather into a list, reduce_scatter from a list, all_to_all,
the coalesced variants) stage through one contiguous buffer and one plait operation, then
copy: one collective's latency instead of one per tensor.

Each ``new_group`` gets its own plait communicator (``plait.init`` on the group's own
PrefixStore), so groups run concurrently and share no state.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import plait
from plait.config import Config
from plait.reduce import ReduceOp

from . import _compat
from ._compat import ServesDevices, WorkBase, profiler_enabled
from .debug import ANY, CollectiveCheck

BACKEND_NAME = "plait"
# The devices whose tensors the group moves: CPU only. gloo answers cpu and cuda because it
# stages CUDA tensors through host memory itself; plait refuses CUDA tensors. torch uses
# the answer to place buffers (``_state_dict_utils._broadcast_tensors`` broadcasts on the
# model's device only if the group serves it, else on the group's first device), so
# claiming cuda would hand plait CUDA tensors it cannot move, while "cpu" alone makes torch
# stage a CUDA model's state on the CPU, and ``_get_pg_default_device`` returns cpu without
# gloo's "multiple backends" warning.
DEVICES = ("cpu",)

Tensor = torch.Tensor
Finish = Callable[[], None]
_T = TypeVar("_T")
_RO = dist.ReduceOp
# Keyed by the enum's int value: hashing the pybind enum itself costs ~0.5 us per call.
_RED: dict[int, ReduceOp] = {
    _RO.SUM.value: ReduceOp.SUM, _RO.AVG.value: ReduceOp.AVG,
    _RO.PRODUCT.value: ReduceOp.PROD, _RO.MIN.value: ReduceOp.MIN,
    _RO.MAX.value: ReduceOp.MAX, _RO.BAND.value: ReduceOp.BAND,
    _RO.BOR.value: ReduceOp.BOR, _RO.BXOR.value: ReduceOp.BXOR,
}
_PREMUL_SUM = _RO.PREMUL_SUM.value


def _reduce_op(red: Any) -> tuple[ReduceOp, float | Tensor | None]:
    """plait's op for a ``dist.ReduceOp`` and, for PREMUL_SUM, the factor to apply first."""
    kind = red.op.value
    op = _RED.get(kind)
    if op is not None:
        return op, None
    if kind == _PREMUL_SUM:
        return ReduceOp.SUM, _compat.premul_factor(red)
    raise ValueError(f"plait: unsupported reduce op {red.op}")


class PlaitWork(WorkBase):  # type: ignore[misc]
    """An asynchronous plait operation seen as a c10d Work.

    ``wait()`` raises the operation's own error (a :class:`plait.PlaitError`);
    ``get_future()`` gives a future whose value is the list of output tensors and which
    fails in Python and in C++ when the operation fails.
    """

    def __init__(self, fut: torch.futures.Future[Any], works: Sequence[Any],
                 outputs: list[Tensor], public: torch.futures.Future[Any] | None = None
                 ) -> None:
        super().__init__()
        self._fut = fut  # completed by _Completion: set_result(outputs) or set_exception
        self._public = fut if public is None else public  # the profiled future, if any
        self._works = works
        self._outputs = outputs
        self._cpp_fut: torch.futures.Future[Any] | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = _compat.wait_seconds(timeout)
        if seconds is not None and not self._fut.done():
            deadline = time.monotonic() + seconds
            for w in self._works:  # raises plait.CommTimeoutError when the wait expires
                w.wait(timeout=max(deadline - time.monotonic(), 1e-6))
        self._fut.wait()  # raises the operation's error (set_exception)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        if self._cpp_fut is None:
            self._cpp_fut = _compat.cpp_future(self._public)
        return self._cpp_fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        return _future_error(self._fut) if self._fut.done() else None

    def result(self) -> list[Tensor]:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        self.wait()
        src = self._works[0].source
        return -1 if src is None else int(src)

    # -- what the coalescing manager combines (_end_coalescing) ----------------------
    @property
    def outputs(self) -> list[Tensor]:
        """The output tensors, as the future's value lists them."""
        return self._outputs

    @property
    def plait_works(self) -> Sequence[Any]:
        """The plait operations under this Work (``wait(timeout)`` waits on them)."""
        return self._works

    def add_done_callback(self, fn: Callable[[torch.futures.Future[Any]], None]) -> None:
        """Call ``fn(future)`` when the operation completes; ``future.value()`` raises its
        error. On the future plait completes itself, not the profiled one handed to
        callers (that one only adds the end of a profiler range)."""
        self._fut.add_done_callback(fn)

    def source_rank(self) -> int:
        return self._source_rank()


class _DoneWork(WorkBase):  # type: ignore[misc]
    """The Work returned by every synchronous call: already complete, shared."""

    def __init__(self) -> None:
        super().__init__()
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result([])
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None


_DONE = _DoneWork()


class _Completion:
    """Completes a torch future when the last of ``n`` plait works completes."""

    __slots__ = ("error", "finish", "fut", "lock", "outputs", "pending")

    def __init__(self, n: int, fut: torch.futures.Future[Any], outputs: list[Tensor],
                 finish: Finish | None) -> None:
        self.pending = n
        self.fut = fut
        self.outputs = outputs
        self.finish = finish
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def __call__(self, work: Any) -> None:
        """plait's done callback."""
        self.complete(work.exception())

    def complete(self, exc: BaseException | None) -> None:
        with self.lock:
            if exc is not None and self.error is None:
                self.error = exc
            self.pending -= 1
            if self.pending:
                return
        error = self.error
        if error is None and self.finish is not None:
            try:
                self.finish()
            except BaseException as e:  # delivered through the future
                error = e
        if error is None:
            self.fut.set_result(self.outputs)
        else:
            self.fut.set_exception(error)


def _red_name(op: ReduceOp, factor: Any) -> str:
    return "PREMUL_SUM" if factor is not None else op.name


def _one(items: Sequence[_T], op: str) -> _T:
    if len(items) != 1:
        raise ValueError(f"plait {op}: expected exactly one tensor (list) per process, got "
                         f"{len(items)}")
    return items[0]


def _contiguous(t: Tensor, finish: list[Finish]) -> Tensor:
    """``t`` if contiguous, else a contiguous copy written back to ``t`` by ``finish``."""
    if t.is_contiguous():
        return t
    tmp = t.contiguous()
    finish.append(lambda: _copy(t, tmp))
    return tmp


def _flat_cat(tensors: Sequence[Tensor]) -> Tensor:
    if not tensors:
        raise ValueError("plait: empty tensor list")
    return torch.cat([t.reshape(-1) for t in tensors])


def _copy(dst: Tensor, flat: Tensor) -> None:
    dst.copy_(flat.view(dst.shape))


def _unflatten_into(flat: Tensor, outputs: Sequence[Tensor]) -> None:
    off = 0
    for o in outputs:
        n = o.numel()
        o.copy_(flat[off:off + n].view(o.shape))
        off += n


def _run_finish(finish: list[Finish]) -> Finish | None:
    if not finish:
        return None
    if len(finish) == 1:
        return finish[0]

    def run() -> None:
        for f in finish:
            f()

    return run


class ProcessGroupPlait(ServesDevices, dist.ProcessGroup):  # type: ignore[misc]
    """A torch.distributed process group whose operations run on a plait communicator."""

    SERVED_DEVICES = DEVICES

    def __init__(self, store: dist.Store, rank: int, size: int,
                 timeout: datetime.timedelta | float | None = None, *,
                 group_name: str = "", config: Config | None = None,
                 comm: plait.Communicator | None = None) -> None:
        """``comm``: an existing communicator of this rank and size to run on (a shrunk
        one: plait.torch.shrink) instead of one made by ``plait.init`` on ``store``."""
        # torch 2.13: passing the store to the base constructor fails ("returned holder-
        # wrapped instance is not an alias instance"); plait keeps it (TORCH_NOTES.md).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._store: dist.Store | None = store
        self._comm: Any = comm if comm is not None else plait.init(
            rank, size, store=store, timeout=timeout, config=config)
        self._group_name = group_name
        self._group_desc = ""
        self.shrink_result: plait.ShrinkResult[plait.Communicator] | None = None
        self._coalesced: list[PlaitWork] | None = None
        self._closed = False
        self._check: CollectiveCheck | None = None
        if Config.resolve(config).debug == "check":
            from plait import check

            check.uninstall(self._comm)  # this backend checks with torch's op names
            self._check = CollectiveCheck(self._comm, lambda: self._group_name)

    # -- identity (without a group name, FSDP2 / DeviceMesh / funcol fail) ------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def comm(self) -> plait.Communicator:
        """The plait communicator under this group."""
        return self._comm

    @property
    def store(self) -> dist.Store | None:
        """The store this group met on (None once destroyed)."""
        return self._store

    # -- the two paths --------------------------------------------------------------
    def _sync(self, name: str, start: Callable[[], Any], finish: Finish | None) -> WorkBase:
        if profiler_enabled():
            with record_function(name):
                start()
                if finish is not None:
                    finish()
        else:
            start()
            if finish is not None:
                finish()
        return _DONE

    def _async(self, name: str, start: Callable[[], Any], outputs: list[Tensor],
               finish: Finish | None) -> PlaitWork:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        public = _compat.profile_future(name, fut) if profiler_enabled() else fut
        try:
            started = start()
        except BaseException as exc:  # invalid arguments: raise, and end the profiler range
            fut.set_exception(exc)
            raise
        works = started if isinstance(started, list) else [started]
        work = PlaitWork(fut, works, outputs, public)
        done = _Completion(max(len(works), 1), fut, outputs, finish)
        for w in works:
            w.add_done_callback(done)
        if not works:
            done.complete(None)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _go(self, name: str, async_op: bool, start: Callable[[bool], Any],
            outputs: list[Tensor], finish: Finish | None = None) -> WorkBase:
        """Run ``start(async_op)`` (one plait call or a list of them) as a c10d Work."""
        if not async_op and self._coalesced is None:
            return self._sync(name, lambda: start(False), finish)
        return self._async(name, lambda: start(True), outputs, finish)

    def allreduce_inplace(self, t: Tensor, op: ReduceOp) -> None:
        """Reduce the contiguous CPU tensor ``t`` in place over the group and return when
        done: the synchronous path of :meth:`allreduce` without c10d's options and Work
        (``torch.ops.plait.all_reduce_`` calls it). Checked (``PLAIT_DEBUG=check``),
        numbered and recorded like every operation of the group."""
        if self._check is not None:
            self._check("allreduce", t.dtype, t.numel(), ANY, op.name)
        if profiler_enabled():
            with record_function("plait::allreduce"):
                self._comm.allreduce(t, op)
        else:
            self._comm.allreduce(t, op)

    # -- allreduce ------------------------------------------------------------------
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> WorkBase:  # type: ignore[override]
        if opts is None:
            opts = AllreduceOptions()
        if len(tensors) != 1:
            _one(tensors, "allreduce")
        t = tensors[0]
        op, factor = _reduce_op(opts.reduceOp)
        if (factor is None and not opts.asyncOp and self._coalesced is None
                and t.is_contiguous()):
            # The latency-critical path: no closure, no Work, no future.
            self.allreduce_inplace(t, op)
            return _DONE
        if self._check is not None:
            self._check("allreduce", t.dtype, t.numel(), ANY, _red_name(op, factor))
        if factor is not None:
            t.mul_(factor)
        comm = self._comm
        finish: list[Finish] = []
        buf = _contiguous(t, finish)
        return self._go("plait::allreduce", opts.asyncOp,
                        lambda a: comm.allreduce(buf, op, async_op=a), tensors,
                        _run_finish(finish))

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> WorkBase:
        if opts is None:
            opts = AllreduceCoalescedOptions()
        op, factor = _reduce_op(opts.reduceOp)
        if self._check is not None:
            self._check("allreduce_coalesced", tensors[0].dtype if tensors else None,
                        sum(t.numel() for t in tensors), ANY, _red_name(op, factor))
        comm = self._comm
        if len({t.dtype for t in tensors}) == 1:
            flat = _flat_cat(tensors)
            if factor is not None:
                flat.mul_(factor)
            return self._go("plait::allreduce_coalesced", opts.asyncOp,
                            lambda a: comm.allreduce(flat, op, async_op=a), tensors,
                            lambda: _unflatten_into(flat, tensors))
        # Mixed dtypes: one allreduce per tensor, in order.
        bufs = [t.contiguous() for t in tensors]
        if factor is not None:
            for b in bufs:
                b.mul_(factor)

        def start(a: bool) -> Any:
            works = [comm.allreduce(b, op, async_op=a) for b in bufs]
            return works if a else None

        def finish() -> None:
            for t, b in zip(tensors, bufs, strict=True):
                if t is not b:
                    t.copy_(b)

        return self._go("plait::allreduce_coalesced", opts.asyncOp, start, tensors, finish)

    # -- rooted ops -----------------------------------------------------------------
    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> WorkBase:  # type: ignore[override]
        if opts is None:
            opts = BroadcastOptions()
        t = _one(tensors, "broadcast")
        root = opts.rootRank
        if self._check is not None:
            self._check("broadcast", t.dtype, t.numel(), root)
        comm = self._comm
        finish: list[Finish] = []
        buf = _contiguous(t, finish)
        return self._go("plait::broadcast", opts.asyncOp,
                        lambda a: comm.broadcast(buf, root, async_op=a), tensors,
                        _run_finish(finish))

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> WorkBase:  # type: ignore[override]
        if opts is None:
            opts = ReduceOptions()
        t = _one(tensors, "reduce")
        op, factor = _reduce_op(opts.reduceOp)
        root = opts.rootRank
        if self._check is not None:
            self._check("reduce", t.dtype, t.numel(), root, _red_name(op, factor))
        comm = self._comm
        finish: list[Finish] = []
        if factor is not None:
            # Scale a copy: reduce leaves non-root buffers unchanged.
            buf = t.mul(factor).contiguous()
            if self.rank() == root:
                finish.append(lambda: _copy(t, buf))
        else:
            buf = _contiguous(t, finish)
        return self._go("plait::reduce", opts.asyncOp,
                        lambda a: comm.reduce(buf, root, op, async_op=a), tensors,
                        _run_finish(finish))

    def gather(self, output_lists: list[list[Tensor]], inputs: list[Tensor],  # type: ignore[override]
               opts: Any = None) -> WorkBase:
        if opts is None:
            opts = GatherOptions()
        inp = _one(inputs, "gather").contiguous()
        root = opts.rootRank
        if self._check is not None:
            self._check("gather", inp.dtype, inp.numel(), root)
        comm = self._comm
        if self.rank() == root:
            outs = _one(output_lists, "gather")
            staging = torch.empty(inp.numel() * self.size(), dtype=inp.dtype)
            return self._go("plait::gather", opts.asyncOp,
                            lambda a: comm.gather(inp, staging, root, async_op=a), outs,
                            lambda: _unflatten_into(staging, outs))
        return self._go("plait::gather", opts.asyncOp,
                        lambda a: comm.gather(inp, None, root, async_op=a), [])

    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]],  # type: ignore[override]
                opts: Any = None) -> WorkBase:
        if opts is None:
            opts = ScatterOptions()
        out = _one(outputs, "scatter")
        root = opts.rootRank
        if self._check is not None:
            self._check("scatter", out.dtype, out.numel(), root)
        comm = self._comm
        finish: list[Finish] = []
        buf = _contiguous(out, finish)
        send = _flat_cat(_one(input_lists, "scatter")) if self.rank() == root else None
        return self._go("plait::scatter", opts.asyncOp,
                        lambda a: comm.scatter(send, buf, root, async_op=a), outputs,
                        _run_finish(finish))

    # -- allgather ------------------------------------------------------------------
    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor],  # type: ignore[override]
                  opts: Any = None) -> WorkBase:
        if opts is None:
            opts = AllgatherOptions()
        inp = _one(inputs, "allgather").contiguous()
        outs = _one(output_lists, "allgather")
        if self._check is not None:
            even = all(o.numel() == inp.numel() for o in outs)
            self._check("allgather", inp.dtype, inp.numel() if even else ANY)
        comm = self._comm
        counts = [o.numel() for o in outs]
        staging = torch.empty(sum(counts), dtype=inp.dtype)
        if all(c == inp.numel() for c in counts):
            def start(a: bool) -> Any:
                return comm.allgather(inp, staging, async_op=a)
        else:  # uneven sizes: allgatherv
            def start(a: bool) -> Any:
                return comm.allgatherv(inp, staging, counts, async_op=a)
        return self._go("plait::allgather", opts.asyncOp, start, outs,
                        lambda: _unflatten_into(staging, outs))

    def all_gather_single(self, output: Tensor, input: Tensor,
                          opts: Any = None) -> WorkBase:
        if opts is None:
            opts = AllgatherOptions()
        comm = self._comm
        finish: list[Finish] = []
        out = _contiguous(output, finish)
        if self._check is not None:
            self._check("all_gather_into_tensor", input.dtype, input.numel())
        inp = input.contiguous()
        return self._go("plait::all_gather_into_tensor", opts.asyncOp,
                        lambda a: comm.allgather(inp, out, async_op=a), [output],
                        _run_finish(finish))

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def allgather_coalesced(self, output_lists: list[list[Tensor]], inputs: list[Tensor],
                            opts: Any = None) -> WorkBase:
        """``output_lists[r][k]`` receives rank r's ``inputs[k]``."""
        if opts is None:
            opts = AllgatherOptions()
        flat_in = _flat_cat(inputs)
        if self._check is not None:
            self._check("allgather_coalesced", flat_in.dtype, flat_in.numel())
        staging = torch.empty(flat_in.numel() * self.size(), dtype=flat_in.dtype)
        comm = self._comm
        outs = [o for per_rank in output_lists for o in per_rank]
        return self._go("plait::allgather_coalesced", opts.asyncOp,
                        lambda a: comm.allgather(flat_in, staging, async_op=a), outs,
                        lambda: _unflatten_into(staging, outs))

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                    opts: Any = None) -> WorkBase:
        """Several all_gather_into_tensor at once: ``outputs[i]`` = size x ``inputs[i]``."""
        if opts is None:
            opts = AllgatherOptions()
        size = self.size()
        flat_in = _flat_cat(inputs)
        total = flat_in.numel()
        if self._check is not None:
            self._check("all_gather_into_tensor_coalesced", flat_in.dtype, total)
        staging = torch.empty(total * size, dtype=flat_in.dtype)
        comm = self._comm

        def finish() -> None:
            per_rank = staging.view(size, total)
            off = 0
            for inp, out in zip(inputs, outputs, strict=True):
                n = inp.numel()
                out.view(size, n).copy_(per_rank[:, off:off + n])
                off += n

        return self._go("plait::all_gather_into_tensor_coalesced", opts.asyncOp,
                        lambda a: comm.allgather(flat_in, staging, async_op=a), outputs,
                        finish)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    # -- reduce_scatter -------------------------------------------------------------
    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]],  # type: ignore[override]
                       opts: Any = None) -> WorkBase:
        if opts is None:
            opts = ReduceScatterOptions()
        out = _one(outputs, "reduce_scatter")
        ins = _one(input_lists, "reduce_scatter")
        op, factor = _reduce_op(opts.reduceOp)
        if self._check is not None:
            self._check("reduce_scatter", out.dtype, out.numel(), ANY, _red_name(op, factor))
        comm = self._comm
        flat = _flat_cat(ins)
        if factor is not None:
            flat.mul_(factor)
        if all(t.numel() == out.numel() for t in ins):
            finish: list[Finish] = []
            buf = _contiguous(out, finish)
            return self._go("plait::reduce_scatter", opts.asyncOp,
                            lambda a: comm.reduce_scatter(flat, buf, op, async_op=a),
                            outputs, _run_finish(finish))
        # Uneven chunks: reduce everything, keep this rank's chunk.
        off = sum(t.numel() for t in ins[:self.rank()])
        return self._go("plait::reduce_scatter", opts.asyncOp,
                        lambda a: comm.allreduce(flat, op, async_op=a), outputs,
                        lambda: _copy(out, flat[off:off + out.numel()]))

    def reduce_scatter_single(self, output: Tensor, input: Tensor,
                              opts: Any = None) -> WorkBase:
        if opts is None:
            opts = ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        if self._check is not None:
            self._check("reduce_scatter_tensor", output.dtype, output.numel(), ANY,
                        _red_name(op, factor))
        comm = self._comm
        inp = input.mul(factor).contiguous() if factor is not None else input.contiguous()
        finish: list[Finish] = []
        out = _contiguous(output, finish)
        return self._go("plait::reduce_scatter_tensor", opts.asyncOp,
                        lambda a: comm.reduce_scatter(inp, out, op, async_op=a), [output],
                        _run_finish(finish))

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> WorkBase:
        """Several reduce_scatter_tensor at once: ``inputs[i]`` = size x ``outputs[i]``."""
        if opts is None:
            opts = ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        size = self.size()
        comm = self._comm
        if self._check is not None:
            self._check("reduce_scatter_tensor_coalesced", outputs[0].dtype if outputs else None,
                        sum(o.numel() for o in outputs), ANY, _red_name(op, factor))
        # Rank-major staging: rank r's block holds chunk r of every input, in order.
        staging = torch.cat([t.reshape(size, -1) for t in inputs], dim=1).reshape(-1)
        if factor is not None:
            staging.mul_(factor)
        result = torch.empty(staging.numel() // size if size else 0, dtype=staging.dtype)
        return self._go("plait::reduce_scatter_tensor_coalesced", opts.asyncOp,
                        lambda a: comm.reduce_scatter(staging, result, op, async_op=a),
                        outputs, lambda: _unflatten_into(result, outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- all-to-all -----------------------------------------------------------------
    def all_to_all_single(self, output: Tensor, input: Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> WorkBase:
        """Splits count rows (dim 0); ``[]`` means equal splits."""
        if opts is None:
            opts = AllToAllOptions()
        comm = self._comm
        finish: list[Finish] = []
        out = _contiguous(output, finish)
        inp = input.contiguous()
        if self._check is not None:
            even = not output_split_sizes and not input_split_sizes
            self._check("all_to_all_single", input.dtype, input.numel() if even else ANY)
        if not output_split_sizes and not input_split_sizes:
            def start(a: bool) -> Any:
                return comm.alltoall(inp, out, async_op=a)
        else:
            size = self.size()
            send_counts = _counts(input_split_sizes, inp, size)
            recv_counts = _counts(output_split_sizes, out, size)

            def start(a: bool) -> Any:
                return comm.alltoallv(inp, send_counts, out, recv_counts, async_op=a)
        return self._go("plait::all_to_all_single", opts.asyncOp, start, [output],
                        _run_finish(finish))

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor],
                 opts: Any = None) -> WorkBase:
        if opts is None:
            opts = AllToAllOptions()
        comm = self._comm
        flat_in = _flat_cat(inputs)
        if self._check is not None:
            self._check("all_to_all", flat_in.dtype)
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        staging = torch.empty(sum(recv_counts), dtype=flat_in.dtype)
        return self._go("plait::all_to_all", opts.asyncOp,
                        lambda a: comm.alltoallv(flat_in, send_counts, staging, recv_counts,
                                                 async_op=a),
                        outputs, lambda: _unflatten_into(staging, outputs))

    # -- barrier --------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> WorkBase:
        if opts is None:
            opts = BarrierOptions()
        if self._check is not None:
            self._check("barrier")
        comm = self._comm
        return self._go("plait::barrier", opts.asyncOp,
                        lambda a: comm.barrier(async_op=a), [])

    # -- point to point: always asynchronous (dist.send/recv wait on the result) -----
    def send(self, tensors: list[Tensor], dst: int, tag: int) -> WorkBase:
        t = _one(tensors, "send").contiguous()
        comm = self._comm
        return self._async("plait::send", lambda: comm.isend(t, dst, tag), tensors, None)

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> WorkBase:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[Tensor], tag: int) -> WorkBase:
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[Tensor], src: int | None, tag: int) -> WorkBase:
        t = _one(tensors, "recv")
        comm = self._comm
        finish: list[Finish] = []
        buf = _contiguous(t, finish)
        return self._async("plait::recv", lambda: comm.irecv(buf, src, tag), tensors,
                           _run_finish(finish))

    # -- coalescing manager (with a device): every op in between is collected ---------
    def _start_coalescing(self, device: Any = None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("plait: coalescing already started on this group")
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> WorkBase:
        works, self._coalesced = self._coalesced or [], None
        fut: torch.futures.Future[Any] = torch.futures.Future()
        outputs = [t for w in works for t in w.outputs]
        if not works:
            fut.set_result(outputs)
            return PlaitWork(fut, [], outputs)
        done = _Completion(len(works), fut, outputs, None)

        def one_done(f: torch.futures.Future[Any]) -> None:
            done.complete(_future_error(f))

        for w in works:
            w.add_done_callback(one_done)
        return PlaitWork(fut, [w for pw in works for w in pw.plait_works], outputs)

    # -- shutdown -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the communicator (destroy_process_group calls this)."""
        self._release(abort=False)

    def abort(self) -> None:
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        comm = self._comm
        stop = getattr(comm, "abort", None) if abort else None
        (stop or comm.close)()
        # Users keep group objects after destroy_process_group; drop what holds sockets,
        # file descriptors and the store (its server, on rank 0) so nothing outlives it.
        self._comm = _Destroyed(self.rank(), self._group_name)
        self._check = None
        self._store = None


class _Destroyed:
    """Stands for the communicator of a destroyed group: every use raises ClosedError."""

    def __init__(self, rank: int, group: str) -> None:
        self._what = f"rank {rank}: process group {group!r} was destroyed"

    def __getattr__(self, name: str) -> Any:
        raise plait.ClosedError(f"{self._what}; {name} is not possible")


def _future_error(f: torch.futures.Future[Any]) -> BaseException | None:
    """The error a completed future holds, or None."""
    try:
        f.value()
    except BaseException as exc:  # returned, not swallowed
        return exc
    return None


def _counts(splits: list[int], t: Tensor, size: int) -> list[int]:
    """Element counts per rank from dim-0 split sizes (``[]``: equal splits)."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(f"plait all_to_all_single: {rows} rows do not split evenly "
                             f"over {size} ranks")
        return [rows // size * per_row] * size
    if len(splits) != size:
        raise ValueError(f"plait all_to_all_single: {len(splits)} split sizes for {size} "
                         "ranks")
    return [int(s) * per_row for s in splits]


# -- registration -------------------------------------------------------------------
def _create(backend_opts: Any, pg_options: Any = None) -> ProcessGroupPlait:
    """The creator ``register_backend(..., extended_api=True)`` calls for each group;
    ``pg_options`` (``init_process_group(..., pg_options=plait.Config(...))`` or
    ``new_group(..., pg_options=...)``) may carry plait's settings."""
    store, rank, size, timeout, group_name, _ranks = _compat.backend_options(backend_opts)
    if pg_options is not None and not isinstance(pg_options, Config):
        raise TypeError(f"rank {rank}, init_process_group: pg_options for the plait backend "
                        f"must be a plait.Config, not {type(pg_options).__name__}")
    return ProcessGroupPlait(store, rank, size, timeout, group_name=group_name,
                             config=pg_options)


_lock = threading.Lock()


def register() -> None:
    """Register the ``plait`` backend and the ``plait://`` rendezvous. Idempotent."""
    with _lock:
        if BACKEND_NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                          devices=list(DEVICES))
        from . import rendezvous

        rendezvous.register()
