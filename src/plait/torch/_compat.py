"""Every private or version-specific torch API plait's backend touches, in one place.

torch 2.13 has no public base class for a Python backend (PyTorch's main branch announces a
``dist.BackendBase``). Until it does, plait relies on the items below. Each is checked by
:func:`check` and by ``tests/torch/test_compat.py``, which fail loudly, naming the item,
when a torch release changes one of them. Nothing else in ``plait.torch`` may use a
private torch name.

- ``torch.distributed._Work``: the Python-subclassable c10d Work. C++ callers (DDP's
  reducer, functional collectives) need a real c10d Work; the C++ wrapper forwards only
  ``wait(timeout)`` and ``get_future()`` to Python.
- ``torch.futures.Future.set_exception`` stores the exception as the future's *value*
  with a Python-only unwrap function, so C++ ``getFuture()->wait()`` would see success.
  :func:`cpp_future` chains ``then(_reraise)``, whose raising callback marks the chained
  future as failed in C++ too (see ../shared/TORCH_NOTES.md, "Work objects and errors").
- ``record_function._call_end_callbacks_on_future``: ends a profiler range when an async
  operation's future completes (a range entered in a worker thread is not captured).
- ``_DistributedBackendOptions``: what ``register_backend(..., extended_api=True)`` passes
  to the creator (``store``, ``group_rank``, ``group_size``, ``timeout``, ``group_id``,
  ``global_ranks_in_group``).
- ``ReduceOp.factor``: the scale of a ``PREMUL_SUM`` made by
  ``dist._make_nccl_premul_sum`` (a float or a tensor).
- ``*Options.asyncOp``: set by ``torch.distributed``'s Python functions to the caller's
  ``async_op`` (C++ callers leave the default, True). A synchronous call can thus run
  inline and return a completed Work without a future.
- ``distributed_c10d._resolve_process_group``: the group registered under a name, as
  functional collectives name groups (``torch.ops.plait.all_reduce_`` takes one).
- ``ProcessGroup._device_types``: the devices a group serves. torch fills it only through
  ``_register_backend``, which needs a C++ ``Backend`` (not constructible from Python)
  and which ``_new_process_group_helper`` skips for a group that is a ``ProcessGroup``
  subclass. So a Python group answers ``[]``, and torch's Python readers fail:
  DCP ``async_save`` ("A CPU backend must be enabled"), ``_state_dict_utils.
  _broadcast_tensors`` (``pg._device_types[0]``: IndexError) and
  ``_get_pg_default_device`` ("Default device not found", DCP of FSDP1 models).
  :class:`ServesDevices` overrides the property; C++ readers still see no backend, so
  any path that would fetch a C++ backend through ``_get_backend`` fails loudly as before.
- ``distributed_c10d._register_pg_in_world``: enters a group made outside ``new_group``
  (``plait.torch.shrink``) in torch's tables (backend and store, name, global ranks,
  the name registry functional collectives resolve), as torch's own ``shrink_group``
  does; torch's ``shrink_group`` itself needs a C++ backend.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.distributed_c10d import _resolve_process_group

WorkBase = dist._Work
"""Base class of plait's c10d Work objects."""

profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled
"""True while torch.profiler or torch.autograd.profiler records on this thread (~0.2 us)."""

_NO_TIMEOUT = datetime.timedelta(0)


class ServesDevices:
    """Mixin of a Python ``dist.ProcessGroup`` subclass: the devices the group serves.

    ``SERVED_DEVICES`` names them; the subclass sets it. Every reader of
    ``_device_types`` in torch 2.13's Python code (checkpoint, state_dict utilities,
    ``_get_pg_default_device``, ``_device_capability``, object collectives) goes through
    Python attribute lookup, which finds this property before the C++ one.
    """

    SERVED_DEVICES: tuple[str, ...] = ()

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in self.SERVED_DEVICES]


def _reraise(fut: torch.futures.Future[Any]) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


def cpp_future(fut: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
    """A future over ``fut`` that fails in C++ too when ``fut`` got ``set_exception``."""
    return fut.then(_reraise)


def profile_future(name: str, fut: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
    """Open a profiler range ``name`` now and close it when ``fut`` completes.

    Returns the future to hand out instead of ``fut`` (it completes after the range ends).
    """
    rf = record_function(name)
    rf.__enter__()
    return rf._call_end_callbacks_on_future(fut)


def backend_options(opts: Any) -> tuple[Any, int, int, datetime.timedelta, str, list[int]]:
    """(store, rank, size, timeout, group name, global ranks) of ``_DistributedBackendOptions``.

    ``global ranks`` is empty for the default (world) group.
    """
    return (opts.store, int(opts.group_rank), int(opts.group_size), opts.timeout,
            str(opts.group_id), list(opts.global_ranks_in_group))


def premul_factor(op: Any) -> float | torch.Tensor:
    """The scale factor of a PREMUL_SUM ``dist.ReduceOp``."""
    return op.factor  # type: ignore[no-any-return]


def wait_seconds(timeout: Any) -> float | None:
    """A c10d ``Work.wait`` timeout (timedelta; 0 means none) as seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    return seconds if seconds > 0 else None


def register_group(pg: Any, backend: str, store: Any, name: str,
                   global_to_group: dict[int, int]) -> None:
    """Enter ``pg`` (made outside ``new_group``) in torch's process-group tables."""
    dist.distributed_c10d._register_pg_in_world(
        pg=pg, backend_name=backend, store=store, group_name=name,
        backend_config=f"cpu:{backend}", rank_mapping=global_to_group)


def resolve_group(group_name: str) -> Any:
    """The process group registered under ``group_name`` (as functional collectives name
    groups); RuntimeError when there is none."""
    return _resolve_process_group(group_name)


def check() -> list[str]:
    """Problems with the private torch APIs above in this torch build (empty when fine)."""
    problems: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    need(isinstance(getattr(dist, "_Work", None), type), "torch.distributed._Work is gone")
    need(isinstance(getattr(dist.ProcessGroup, "_device_types", None), property),
         "ProcessGroup._device_types is no longer a property (the devices a group serves "
         "are read differently)")
    need(hasattr(dist.ProcessGroup, "_set_group_name"),
         "ProcessGroup._set_group_name is gone (group names are set differently)")
    need(hasattr(record_function, "_call_end_callbacks_on_future"),
         "record_function._call_end_callbacks_on_future is gone")
    need(callable(getattr(dist.distributed_c10d, "_resolve_process_group", None)),
         "torch.distributed.distributed_c10d._resolve_process_group is gone (groups are "
         "looked up by name differently)")
    need(callable(getattr(torch.autograd, "_profiler_enabled", None)),
         "torch.autograd._profiler_enabled is gone")
    need(callable(getattr(dist.distributed_c10d, "_register_pg_in_world", None)),
         "distributed_c10d._register_pg_in_world is gone (plait.torch.shrink cannot enter "
         "its group in torch's tables)")
    try:
        from torch.distributed.distributed_c10d import _DistributedBackendOptions

        o = _DistributedBackendOptions()
        for name in ("store", "group_rank", "group_size", "timeout", "group_id",
                     "global_ranks_in_group"):
            need(hasattr(o, name), f"_DistributedBackendOptions.{name} is gone")
    except ImportError:
        problems.append("torch.distributed.distributed_c10d._DistributedBackendOptions is gone")
    try:
        need(bool(dist._make_nccl_premul_sum(2.0).factor == 2.0),
             "ReduceOp.factor does not give the PREMUL_SUM factor")
    except (AttributeError, RuntimeError) as exc:
        problems.append(f"PREMUL_SUM factor unreadable: {exc}")
    for cls in ("AllreduceOptions", "AllreduceCoalescedOptions", "BroadcastOptions",
                "ReduceOptions", "AllgatherOptions", "GatherOptions", "ScatterOptions",
                "ReduceScatterOptions", "AllToAllOptions", "BarrierOptions"):
        opts_cls = getattr(dist.distributed_c10d, cls, None)
        need(opts_cls is not None and getattr(opts_cls(), "asyncOp", None) is True,
             f"{cls}().asyncOp missing or not True by default")
    # The error path: set_exception + then(_reraise) must fail in C++ (wait() raises).
    fut: torch.futures.Future[Any] = torch.futures.Future()
    chained = cpp_future(fut)
    fut.set_exception(ValueError("probe"))
    try:
        chained.wait()
        problems.append("a chained future of a failed future completed without error")
    except Exception as exc:  # any error type is fine, as long as it raises
        need("probe" in str(exc), f"chained future lost the error message: {exc}")
    return problems
