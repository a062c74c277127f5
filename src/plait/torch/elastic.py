"""``plait.torch.shrink``: the torch counterpart of ``plait.Communicator.shrink``.

After a rank of a plait process group failed (or to drop ranks that are alive), every
survivor calls ``plait.torch.shrink(group)``; it returns a new process group of the
survivors, renumbered in order, agreed on by all of them (plait.shrink), entered in
torch's tables like a ``new_group`` (so ``dist.get_rank(g)``, DDP's
``process_group=g``, functional collectives by group name work). The old group is left
as it is: the default group stays the default (``dist.destroy_process_group()`` at the
end destroys both). ``group.shrink_result`` is the ``plait.ShrinkResult`` (lost and
excluded ranks, last collective completed on every survivor).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from . import _compat
from .backend import BACKEND_NAME, ProcessGroupPlait


def shrink(group: dist.ProcessGroup | None = None, exclude: Sequence[int] | None = None, *,
           timeout: float | datetime.timedelta | None = None) -> ProcessGroupPlait:
    """A process group of ``group``'s survivors (default: the world group); ``exclude``
    and ``timeout`` as in ``plait.Communicator.shrink`` (ranks of ``group``). Raises
    ``plait.ShrinkExcludedError`` on a rank left out, ``plait.StoreLostError`` when the
    store has gone with the lost rank."""
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, ProcessGroupPlait):
        raise TypeError(f"plait.torch.shrink: group {pg!r} is not a plait process group")
    global_ranks = dist.get_process_group_ranks(pg)
    res = pg.comm.shrink(exclude, timeout=timeout)
    new = res.comm
    name = f"plait-shrink-{new.describe()['identity']['communicator'][:16]}"
    out = ProcessGroupPlait(pg.store, new.rank, new.size, group_name=name, comm=new)
    out.shrink_result = res
    _compat.register_group(out, BACKEND_NAME, pg.store, name,
                           {global_ranks[old]: i for i, old in enumerate(res.ranks)})
    return out
