"""Where a rank learns who it is and meets its peers: launcher variables, the store, and
this host's identity.

Rendezvous goes through a torch.distributed Store (TCPStore, FileStore, PrefixStore or
one the caller gives). Host identity decides locality per peer; it is never inferred from
LOCAL_WORLD_SIZE, which is wrong for sub-groups.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

# (rank variable, size variable, launcher) in priority order: first match wins.
LAUNCHERS = (
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_RANK", "PMI_SIZE", "PMI"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
)


def launcher_rank_size(env: Mapping[str, str] | None = None) -> tuple[int, int, str]:
    """(rank, world size, launcher name) from the first launcher whose variables are set."""
    env = os.environ if env is None else env
    for rvar, svar, name in LAUNCHERS:
        if rvar in env and svar in env:
            try:
                return int(env[rvar]), int(env[svar]), name
            except ValueError:
                raise ValueError(f"{name} variables {rvar}={env[rvar]!r}, {svar}={env[svar]!r} "
                                 "are not integers") from None
    raise ValueError("plait.init(): no rank/world size given and no launcher variables found "
                     "(RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/PMI_SIZE, "
                     "SLURM_PROCID/SLURM_NTASKS)")


def store_from_env(rank: int, size: int, timeout_s: float,
                   env: Mapping[str, str] | None = None) -> Any:
    """A TCPStore at MASTER_ADDR:MASTER_PORT: joined as a client when torchrun's agent hosts
    it (TORCHELASTIC_USE_AGENT_STORE=True), otherwise hosted by rank 0."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR")
    port = env.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError(f"rank {rank}, init: no store given and MASTER_ADDR/MASTER_PORT are not "
                         "set")
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(addr, int(port), size, is_master=(rank == 0 and not agent),
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity(override: str | None) -> str:
    """``PLAIT_HOST_ID`` if set, else hostname + boot id + the device of /dev/shm (so that
    containers with a private /dev/shm are not taken for one host)."""
    if override:
        return override
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = -1
    return f"{socket.gethostname()}/{boot_id()}/{shm_dev}"


def interface_address(ifname: str) -> str | None:
    """IPv4 address of a network interface, or None."""
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def route_address(target: str) -> str:
    """The local address the kernel would use to reach ``target`` (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((target, 9))
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def bind_address(ifnames: str, store: Any, env: Mapping[str, str] | None = None,
                 local_rank: int = 0) -> str:
    """Where this rank's TCP listener binds: the configured interface (local rank modulo the
    interface list), else the address that reaches the rendezvous host."""
    env = os.environ if env is None else env
    names = [n.strip() for n in ifnames.split(",") if n.strip()]
    if names:
        name = names[local_rank % len(names)]
        addr = interface_address(name)
        if addr is None:
            raise ValueError(f"PLAIT_SOCKET_IFNAME: interface {name!r} has no IPv4 address")
        return addr
    target = env.get("MASTER_ADDR") or getattr(store, "host", None)
    if target:
        try:
            target = socket.gethostbyname(target)
        except OSError:
            target = None
    if target:
        return route_address(target)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
