"""``PLAIT_DEBUG=check`` for the core API: catch ranks that call different collectives.

Under ``PLAIT_DEBUG=check`` every collective method of a communicator is wrapped (on the
instance, so the normal path pays nothing): before the operation, each rank validates
what it can locally (buffers, root, reduce op), then the ranks allgather a descriptor
(operation, dtype, element count, root, reduce op, "my arguments are invalid") and
compare. On a difference every rank raises :class:`MismatchError` listing each rank's
values -- before the operation itself, so nobody hangs in it and the communicator stays
usable. A rank whose own arguments are invalid raises its own ValueError/TypeError after
the exchange, and the others a MismatchError that names it. The cost is one small
allgather per collective: a debugging aid, off by default.

The torch backend checks with torch's operation names (``plait.torch.debug``), through
the same exchange (:func:`agree`), and turns this wrapper off for its communicators.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .args import check_rank
from .buffers import as_buf
from .errors import MismatchError
from .reduce import DTYPES, ReduceOp

ANY = -1
# method -> (buffer giving dtype, buffer giving the count or None, root argument, reduce
# op argument). Counts are the ones every rank must agree on.
SPECS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "allreduce": ("buf", "buf", None, "op"),
    "reduce": ("buf", "buf", "root", "op"),
    "broadcast": ("buf", "buf", "root", None),
    "allgather": ("sendbuf", "sendbuf", None, None),
    "allgatherv": ("recvbuf", "recvbuf", None, None),
    "gather": ("sendbuf", "sendbuf", "root", None),
    "scatter": ("recvbuf", "recvbuf", "root", None),
    "reduce_scatter": ("recvbuf", "recvbuf", None, "op"),
    "alltoall": ("sendbuf", "sendbuf", None, None),
    "alltoallv": ("sendbuf", None, None, None),
    "barrier": (None, None, None, None),
}
OPS = tuple(SPECS)
DTYPE_NAMES = tuple(DTYPES)
REDUCE_OPS = tuple(ReduceOp.__members__)
FIELDS = 6


def agree(comm: Any, mine: np.ndarray, every: np.ndarray, header: str,
          describe: Callable[[np.ndarray], str], error: BaseException | None = None) -> None:
    """Allgather this rank's descriptor ``mine`` (int64) into ``every`` (size x len(mine))
    and raise MismatchError, listing each rank's ``describe(row)``, unless all agree.
    ``error`` (this rank's own invalid arguments) is raised after the exchange, so the
    other ranks are not left waiting for it."""
    type(comm).allgather(comm, mine, every)  # the class's method: never a checked wrapper
    if error is not None:
        raise error
    rows = every.reshape(comm.size, len(mine))
    if (rows == rows[0]).all():
        return
    lines = [header] + [f"  rank {r}: {describe(row)}" for r, row in enumerate(rows)]
    raise MismatchError("\n".join(lines))


def install(comm: Any) -> None:
    """Wrap ``comm``'s collective methods with the check."""
    checker = _Checker(comm)
    for name in SPECS:
        setattr(comm, name, checker.wrap(name, getattr(type(comm), name)))


def uninstall(comm: Any) -> None:
    for name in SPECS:
        comm.__dict__.pop(name, None)


class _Checker:
    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.calls = 0
        self.mine = np.zeros(FIELDS, dtype=np.int64)
        self.all = np.zeros(FIELDS * comm.size, dtype=np.int64)

    def wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        sig = inspect.signature(method)

        @functools.wraps(method)
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(self.comm, *args, **kwargs)
            bound.apply_defaults()
            error: BaseException | None = None
            try:
                desc = self.describe(name, bound.arguments)
            except (ValueError, TypeError) as exc:
                error, desc = exc, (OPS.index(name), ANY, ANY, ANY, ANY, 1)
            self.compare(name, desc, error)
            return method(self.comm, *args, **kwargs)

        return checked

    def describe(self, name: str, a: dict[str, Any]) -> tuple[int, ...]:
        comm = self.comm
        bufarg, countarg, rootarg, oparg = SPECS[name]
        dtype = count = root = red = ANY
        if bufarg is not None:
            b = as_buf(a[bufarg], rank=comm.rank, op=name, arg=bufarg,
                       writable=bufarg == "recvbuf")
            dtype = DTYPE_NAMES.index(b.dtype.name)
            if countarg is not None:
                count = b.count if countarg == bufarg else as_buf(
                    a[countarg], rank=comm.rank, op=name, arg=countarg).count
            if oparg is not None:
                rop = ReduceOp.parse(a[oparg], rank=comm.rank, opname=name)
                b.dtype.reducer(rop, rank=comm.rank, opname=name)  # TypeError if undefined
                red = REDUCE_OPS.index(rop.name)
        if rootarg is not None:
            root = check_rank(a[rootarg], comm.size, comm.rank, name, "root")
        return OPS.index(name), dtype, count, root, red, 0

    def compare(self, name: str, desc: tuple[int, ...], error: BaseException | None) -> None:
        self.calls += 1
        self.mine[:] = desc
        agree(self.comm, self.mine, self.all,
              f"rank {self.comm.rank}, {name}: PLAIT_DEBUG=check: ranks disagree on checked "
              f"collective #{self.calls}:", _describe, error)


def _describe(row: np.ndarray) -> str:
    op, dt, count, root, red, bad = (int(x) for x in row)
    if bad:
        return f"{OPS[op]} with invalid arguments (it raised ValueError/TypeError)"
    return " ".join([OPS[op] if 0 <= op < len(OPS) else f"op#{op}",
                     f"dtype={DTYPE_NAMES[dt] if 0 <= dt < len(DTYPE_NAMES) else '-'}",
                     f"count={count if count != ANY else '-'}",
                     f"root={root if root != ANY else '-'}",
                     f"op={REDUCE_OPS[red] if 0 <= red < len(REDUCE_OPS) else '-'}"])
