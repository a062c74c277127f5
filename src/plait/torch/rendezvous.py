"""The ``plait://`` rendezvous for ``init_process_group``: rank, size and store from the launcher.

torch's ``env://`` reads only RANK and WORLD_SIZE, so under ``mpirun`` or ``srun`` it
fails. ``init_method="plait://"`` takes them from the launcher's variables, first match
wins, as ``plait.init`` does: torchrun (RANK, WORLD_SIZE), Open MPI
(OMPI_COMM_WORLD_RANK/SIZE), PMI (PMI_RANK/PMI_SIZE), Slurm (SLURM_PROCID/SLURM_NTASKS).

The store is a TCPStore at ``plait://HOST:PORT`` if the URL names one, else at
MASTER_ADDR:MASTER_PORT: every rank joins as a client when torchrun's agent hosts it
(TORCHELASTIC_USE_AGENT_STORE=True), otherwise rank 0 hosts it. ``rank=`` and
``world_size=`` given to ``init_process_group`` win over the launcher's variables.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from plait.rendezvous import launcher_rank_size, store_from_env

SCHEME = "plait"


def _query(url: str) -> dict[str, str]:
    q = urlparse(url).query
    return dict(p.split("=", 1) for p in q.split("&") if "=" in p)


def _handler(url: str, timeout: datetime.timedelta = datetime.timedelta(seconds=600),
             **_kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    parsed = urlparse(url)
    query = _query(url)
    if int(query.get("world_size", "-1")) > 0 and int(query.get("rank", "-1")) >= 0:
        rank, size = int(query["rank"]), int(query["world_size"])
    else:
        rank, size, _launcher = launcher_rank_size()
    env: dict[str, str] = dict(os.environ)
    if parsed.hostname:
        env["MASTER_ADDR"] = parsed.hostname
    if parsed.port:
        env["MASTER_PORT"] = str(parsed.port)
    if not 0 <= rank < size:
        raise ValueError(f"plait:// rendezvous: rank {rank} is outside world size {size}")
    store = store_from_env(rank, size, timeout.total_seconds(), env)
    yield store, rank, size
    raise RuntimeError("plait:// rendezvous cannot re-rendezvous")


def register() -> None:
    """Register the ``plait://`` handler with torch.distributed (idempotent)."""
    try:
        dist.register_rendezvous_handler(SCHEME, _handler)
    except RuntimeError:  # already registered
        pass
