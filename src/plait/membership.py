"""Who is in a communicator, and what it was derived from.

``Group`` is immutable: rank, size, every rank's host and process, which ranks share this
host's memory, the topology and the ring order. It is what ``init``, ``split``, hier's
sub-communicators and ``shrink`` produce. ``Origin`` is what a communicator is made from:
its keys in the store, the job's identity and secret, its settings, and its failure
``Scope`` (which ancestors' failures break it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .rendezvous import Meeting
from .topology import file as topo_file
from .topology import model as topo_model
from .topology.order import ring_order

ALL = "all"
"""Scope mode: the child's operations are part of the parent's (hier's sub-communicators):
any failure of the parent breaks it."""
MEMBERS = "members"
"""Scope mode: an independent child (split, shrink): only the failure of one of its own
members breaks it (a tensor-parallel group without the lost rank keeps working)."""


@dataclass(frozen=True)
class Scope:
    """The ancestors whose abort notices this communicator watches: (abort key, mode)."""

    parents: tuple[tuple[str, str], ...] = ()

    def child(self, parent_abort_key: str, mode: str) -> Scope:
        if mode == MEMBERS:
            # an independent child watches its ancestors only for its own members
            chain = tuple((k, MEMBERS) for k, _ in self.parents)
        else:
            chain = self.parents
        return Scope(((parent_abort_key, mode), *chain))


@dataclass(frozen=True)
class Group:
    rank: int
    size: int
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    host_local_rank: int  # this process's local rank in the job's world: its rail
    topology: Any  # topology.model.Topology
    ring: tuple[int, ...]  # ring order: ranks of a host, hosts of a switch adjacent
    local_ranks: tuple[int, ...]  # ranks reached through shared memory (this one included)
    local_index: Mapping[int, int] = field(compare=False, default_factory=dict)

    @classmethod
    def from_infos(cls, rank: int, infos: Sequence[Mapping[str, Any]], cfg: Config,
                   host_local_rank: int | None) -> Group:
        """Every rank's rendezvous info (host, pid, discovery) -> the group."""
        hosts = tuple(str(i["host"]) for i in infos)
        topo = topo_model.build(infos, topo_file.load(cfg.topo_file) if cfg.topo_file else None)
        if cfg.transport == "tcp":
            local: tuple[int, ...] = (rank,)
        else:
            local = tuple(r for r in range(len(infos)) if hosts[r] == hosts[rank])
        index = {r: i for i, r in enumerate(local)}
        return cls(rank=rank, size=len(infos), hosts=hosts,
                   pids=tuple(int(i["pid"]) for i in infos),
                   host_local_rank=index[rank] if host_local_rank is None else host_local_rank,
                   topology=topo, ring=tuple(ring_order(topo)), local_ranks=local,
                   local_index=index)

    @property
    def me_local(self) -> int:
        return self.local_index[self.rank]

    @property
    def all_local(self) -> bool:
        return len(self.local_ranks) == self.size

    @property
    def remote(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.size) if r not in self.local_index)

    def is_local(self, rank: int) -> bool:
        return rank in self.local_index

    def process(self, rank: int) -> tuple[str, int]:
        """(host identity, pid): a process's name on every communicator it belongs to."""
        return self.hosts[rank], self.pids[rank]

    def rank_of(self, process: Sequence[Any] | None) -> int | None:
        """This communicator's rank of a process named by ``process`` (host, pid)."""
        if process is None:
            return None
        key = (str(process[0]), int(process[1]))
        for r in range(self.size):
            if (self.hosts[r], self.pids[r]) == key:
                return r
        return None


@dataclass(frozen=True)
class Origin:
    """What a communicator is made from."""

    meet: Meeting  # its keys in the store
    job: bytes
    secret: bytes
    timeout: float
    cfg: Config
    host_local_rank: int | None = None  # None for a world communicator: its own local rank
    scope: Scope = Scope()
    composite: bool = True  # may run composite algorithms (False inside hier's phases)
    owned_store: Any = None  # a store plait made (and so closes with the communicator)

    def child(self, tag: str, *, mode: str, host_local_rank: int, composite: bool = True,
              cfg: Config | None = None) -> Origin:
        """The origin of a communicator derived from this one under key ``tag``."""
        return Origin(meet=self.meet.child(tag), job=self.job, secret=self.secret,
                      timeout=self.timeout, cfg=self.cfg if cfg is None else cfg,
                      host_local_rank=host_local_rank,
                      scope=self.scope.child(self.meet.key("abort"), mode),
                      composite=composite)
