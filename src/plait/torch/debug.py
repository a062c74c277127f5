"""``PLAIT_DEBUG=check``: catch ranks that call different collectives.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps only built-in backends (the plugin path returns
before the wrapper in torch 2.13), so plait checks by itself. Before each collective the
ranks of the group allgather a small descriptor (operation, dtype, element count, root,
reduce op) and compare; on a mismatch every rank raises :class:`plait.MismatchError`
with a message that lists each rank's values. Point-to-point operations are not checked.
The cost is one extra small allgather per collective: a debugging aid, off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from plait.check import agree

OPS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "gather", "scatter",
       "allgather", "all_gather_into_tensor", "allgather_coalesced",
       "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
       "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all", "barrier")
DTYPES = ("-", "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
          "int32", "int64", "bool", "complex64", "complex128")
REDUCE_OPS = ("-", "SUM", "AVG", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
ANY = -1
"""A count or root that is not compared (uneven operations, no root)."""

_FIELDS = 5


class CollectiveCheck:
    """Compares each collective's signature across the ranks of one communicator."""

    def __init__(self, comm: Any, group: Callable[[], str]) -> None:
        self._comm = comm
        self._group = group
        self._calls = 0
        self._mine = np.zeros(_FIELDS, dtype=np.int64)
        self._all = np.zeros(_FIELDS * comm.size, dtype=np.int64)

    def __call__(self, op: str, dtype: Any = None, count: int = ANY, root: int = ANY,
                 reduce_op: str = "-") -> None:
        self._calls += 1
        dt = "-" if dtype is None else str(dtype).removeprefix("torch.")
        self._mine[:] = (OPS.index(op), DTYPES.index(dt) if dt in DTYPES else len(DTYPES),
                         count, root, REDUCE_OPS.index(reduce_op))
        agree(self._comm, self._mine, self._all,
              f"rank {self._comm.rank}, PLAIT_DEBUG=check: ranks disagree on collective "
              f"#{self._calls} of process group {self._group()!r}:", _describe)


def _describe(row: np.ndarray) -> str:
    op, dt, count, root, red = (int(x) for x in row)
    parts = [OPS[op] if 0 <= op < len(OPS) else f"op#{op}",
             f"dtype={DTYPES[dt] if 0 <= dt < len(DTYPES) else 'other'}",
             f"count={count if count != ANY else '-'}",
             f"root={root if root != ANY else '-'}",
             f"reduce_op={REDUCE_OPS[red] if 0 <= red < len(REDUCE_OPS) else red}"]
    return " ".join(parts)
