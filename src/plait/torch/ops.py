"""``torch.ops.plait.all_reduce_``: an in-place allreduce from torch straight to plait.

::

    torch.ops.plait.all_reduce_(t, group.group_name, "sum")   # t is reduced in place

The schema is ``plait::all_reduce_(Tensor(a!) t, str group_name, str op) -> ()``. The
group is named as functional collectives name it (``group.group_name``; the default
group is ``"0"``), ``op`` is one of ``sum``, ``avg``, ``product`` (or ``prod``), ``min``,
``max``, ``band``, ``bor``, ``bxor``, in any case.

The call skips c10d's per-call work (options object, Work, the ``dist.all_reduce``
wrapper): it resolves the group by name (~0.1 us), and runs the group's synchronous
in-place allreduce (:meth:`ProcessGroupPlait.allreduce_inplace`), which is the same
``Communicator.allreduce`` every other operation of the group goes through, so it is
numbered, ordered and recorded (flight recorder, ``PLAIT_DEBUG=check``, profiler range
``plait::allreduce``) like them. It returns when the result is in ``t``.

A fake (meta) kernel lets ``torch.compile`` trace it: dynamo puts it in the graph (no
graph break), AOTAutograd functionalizes the mutation and inductor writes it back in
place. The op has no autograd formula (inference code; a tensor that requires grad
raises in the autograd fallback as for any such op).
"""

from __future__ import annotations

import torch

from plait.reduce import ReduceOp

from . import _compat
from .backend import ProcessGroupPlait

SCHEMA = "all_reduce_(Tensor(a!) t, str group_name, str op) -> ()"

# The names functional collectives use (c10d's to_reduce_op), and plait's own.
OPS: dict[str, ReduceOp] = {
    "sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "product": ReduceOp.PROD,
    "prod": ReduceOp.PROD, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
    "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR,
}


def _reduce_op(op: str) -> ReduceOp:
    red = OPS.get(op)
    if red is None:
        red = OPS.get(op.lower())
        if red is None:
            raise ValueError(f"torch.ops.plait.all_reduce_: unknown reduce op {op!r} "
                             f"(expected one of {', '.join(OPS)})")
    return red


def plait_group(group_name: str) -> ProcessGroupPlait:
    """The plait process group registered under ``group_name``; a clear error otherwise."""
    try:
        pg = _compat.resolve_group(group_name)
    except RuntimeError as exc:
        raise ValueError(f"torch.ops.plait.all_reduce_: no process group named "
                         f"{group_name!r} (destroyed, or never created): {exc}") from None
    if not isinstance(pg, ProcessGroupPlait):
        raise TypeError(f"torch.ops.plait.all_reduce_: process group {group_name!r} is not "
                        f"a plait group (backend {_backend_name(pg)!r}); use "
                        "dist.all_reduce or functional collectives on it")
    return pg


def _backend_name(pg: object) -> str:
    try:
        return str(pg.name())  # type: ignore[attr-defined]
    except Exception:  # a group without a name() gives its type instead
        return type(pg).__name__


def all_reduce_(t: torch.Tensor, group_name: str, op: str) -> None:
    """The CPU kernel: reduce ``t`` in place over the group ``group_name``."""
    pg = plait_group(group_name)
    red = _reduce_op(op)
    if t.is_contiguous():
        pg.allreduce_inplace(t, red)
    else:
        tmp = t.contiguous()
        pg.allreduce_inplace(tmp, red)
        t.copy_(tmp)


def _fake(t: torch.Tensor, group_name: str, op: str) -> None:
    return None


_lib: torch.library.Library | None = None


def register() -> None:
    """Define ``torch.ops.plait.all_reduce_`` (once per process)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("plait", "DEF")
    lib.define(SCHEMA)
    lib.impl("all_reduce_", all_reduce_, "CPU")
    torch.library.register_fake("plait::all_reduce_", _fake, lib=lib)
    _lib = lib
