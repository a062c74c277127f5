"""Where a rank learns who it is and meets its peers: launcher variables, the store, and
this host's identity.

Rendezvous goes through a torch.distributed Store (TCPStore, FileStore, PrefixStore or
one the caller gives). Host identity decides locality per peer; it is never inferred from
LOCAL_WORLD_SIZE, which is wrong for sub-groups.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from .errors import CommTimeoutError, timed_out

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


def restart_attempt(env: Mapping[str, str] | None = None) -> int | None:
    """torchrun's restart count (TORCHELASTIC_RESTART_COUNT) where every rank shares it, else
    None.

    One torchrun agent counts the restarts of its own node's workers. With one agent
    (GROUP_WORLD_SIZE 1: every rank on one node) all ranks see the same count. With
    several, they may not: an agent whose workers failed counts a restart, while another
    whose workers were still running restarts them for the membership change without
    counting (torch.distributed.elastic's agent: "membership changes do not count as
    retries"), so the count cannot name an attempt there.
    """
    env = os.environ if env is None else env
    raw = env.get("TORCHELASTIC_RESTART_COUNT")
    if raw is None or env.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={raw!r} is not an integer") from None


def key_prefix(store: Any, rank: int, size: int, env: Mapping[str, str] | None = None) -> str:
    """The store key prefix of a new communicator of ``size`` ranks on ``store``.

    Several communicators may be made on one store (``plait.init`` called again, torch
    groups on prefixes of one store): each init adds itself to a counter on the store, and
    the ``size`` inits numbered ``g*size+1 .. (g+1)*size`` make generation ``g``.

    torchrun's agent keeps its store across restarts, counter included. If a rank of a
    failed attempt never reached init, the restarted ranks would count from different
    points and disagree on the generation: under torchrun the counter therefore lives
    under the restart attempt (:func:`restart_attempt`), so each attempt counts from zero.
    """
    try:
        attempt = restart_attempt(env)
    except ValueError as exc:
        raise ValueError(f"rank {rank}, init: {exc}") from None
    base = "plait" if attempt is None else f"plait/r{attempt}"
    count = int(store.add(f"{base}/inits", 1))
    return f"{base}/{(count - 1) // size}"


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


class Meeting:
    """One communicator's keys in the store (``<prefix>/<key>``), with plait's deadlines:
    a store's own timeout may be shorter or longer than the operation's."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def child(self, tag: str) -> Meeting:
        """The keys of a communicator derived from this one."""
        return Meeting(self.store, f"{self.prefix}/{tag}")

    def set(self, name: str, value: str | bytes) -> None:
        self.store.set(self.key(name), value)

    def check(self, name: str) -> bool:
        return bool(self.store.check([self.key(name)]))

    def add(self, name: str, amount: int) -> int:
        return int(self.store.add(self.key(name), amount))

    def get(self, name: str, timeout_s: float) -> bytes:
        """The value, once some rank has set it; CommTimeoutError naming the key after
        ``timeout_s``."""
        return wait_key(self.store, self.key(name), timeout_s)


def wait_key(store: Any, key: str, timeout_s: float) -> bytes:
    """store.get with our deadline: poll ``check`` with a growing sleep."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        if store.check([key]):
            return bytes(store.get(key))
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"rendezvous: {timed_out(timeout_s)} for key {key!r} to "
                                   f"appear ({timeout_s:g} s; did every rank join?)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
