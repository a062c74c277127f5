"""Rendezvous of the benchmark's ranks and construction of the backends they measure.

One TCPStore per job (hosted by rank 0, or torchrun's agent store when there is one) is
shared, under separate prefixes, by the control group, the gloo group under test, the
plait backend and plait's own API, so one launcher address serves them all.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backends import Backend, MpiBackend, PlaitBackend, TorchBackend, mpi_missing
from .options import BenchOptions

TIMEOUT_S = 300.0


class Control:
    """The unmeasured gloo group that coordinates the ranks between phases."""

    def __init__(self, group: Any) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.group = torch, dist, group

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def sum(self, values: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        self.dist.all_reduce(t, group=self.group)
        return t.numpy()


def launcher_rank(env: Mapping[str, str] | None = None) -> tuple[int, int, str] | None:
    """(rank, world size, launcher name) when started by a launcher, else None.

    Variables as ``plait.init`` reads them: torchrun, Open MPI, PMI (first match wins).
    """
    env = os.environ if env is None else env
    for name, r, w in (("torchrun", "RANK", "WORLD_SIZE"),
                       ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("pmi", "PMI_RANK", "PMI_SIZE")):
        if r in env and w in env:
            return int(env[r]), int(env[w]), name
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _master(rank: int) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT, or (under mpirun without them) a port chosen by rank 0 and
    broadcast over MPI."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, int(port)
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError("MASTER_ADDR and MASTER_PORT are not set (and mpi4py is missing to "
                           "agree on them): set both, as torchrun does") from None
    chosen = (socket.gethostname(), free_port()) if rank == 0 else None
    host, p = MPI.COMM_WORLD.bcast(chosen, root=0)
    return str(host), int(p)


def make_store(rank: int, size: int) -> Any:
    import torch.distributed as dist

    addr, port = _master(rank)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    return dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout,
                         wait_for_workers=True)


def make_backends(opts: BenchOptions, rank: int,
                  size: int) -> tuple[list[Backend], Control, dict[str, str]]:
    """The measured backends (plait's first), the control group, and skipped backends with
    the reason."""
    import torch.distributed as dist

    store = make_store(rank, size)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", store=dist.PrefixStore("bench/ctl", store), rank=rank,
                            world_size=size, timeout=timeout)
    ctl = Control(dist.group.WORLD)
    skipped: dict[str, str] = {}
    backends: list[Backend] = []
    if opts.api == "plait":
        backends.append(PlaitBackend(rank, size, dist.PrefixStore("bench/plait", store),
                                     TIMEOUT_S))
    else:
        try:
            import plait.torch  # noqa: F401 - registers the "plait" backend
        except ImportError as exc:
            raise RuntimeError(f"--api torch needs plait's torch backend: {exc}") from exc
        group = dist.new_group(backend="plait", timeout=timeout)
        backends.append(TorchBackend(rank, size, group, "plait-torch"))
    for name in opts.compare:
        if name == "gloo":
            group = dist.new_group(backend="gloo", timeout=timeout)
            backends.append(TorchBackend(rank, size, group, "gloo"))
        elif name == "mpi":
            why = mpi_missing()
            if why is None and "OMPI_COMM_WORLD_SIZE" not in os.environ:
                why = "not started by mpirun (plait bench starts itself under mpirun " \
                      "only when it launches the ranks)"
            if why is None:
                backends.append(MpiBackend(rank, size))
            else:
                skipped["mpi"] = why
    return backends, ctl, skipped
