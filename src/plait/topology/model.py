"""The Topology object: hosts -> ranks (local rank, local size, NUMA node) and rails, the
switch each host hangs off, and link classes with bandwidth and latency.

Built identically on every rank of a communicator from what every rank published at
rendezvous (its discovery info) plus the topology file, so that every decision derived
from it (hierarchy, ring order, the cost model's situation) is the same on every rank.
Bandwidths are in bit/s, latencies in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

LINK_CLASSES = ("shm", "switch", "cross_switch")
"""Link classes of the cost model: same host (shared memory), two hosts on one switch,
two hosts on different switches."""


@dataclass(frozen=True)
class Rail:
    """A network interface that carries plait's TCP traffic (one per local rank, modulo)."""

    ifname: str
    address: str | None = None
    bandwidth: float | None = None  # bit/s


@dataclass(frozen=True)
class Interface:
    """A discovered network interface."""

    name: str
    addresses: tuple[str, ...] = ()
    speed: float | None = None  # bit/s (None: unknown, e.g. veth)
    loopback: bool = False


@dataclass(frozen=True)
class LinkClass:
    bandwidth: float | None = None  # bit/s
    latency: float | None = None  # s


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str  # the host's name in the topology
    local_rank: int
    local_size: int
    numa: int | None = None
    pid: int | None = None
    rail: int | None = None  # index into the host's rails, or None without rails


@dataclass(frozen=True)
class Host:
    name: str
    ranks: tuple[int, ...]
    switch: str | None = None
    rack: str | None = None
    rails: tuple[Rail, ...] = ()
    interfaces: tuple[Interface, ...] = ()
    identity: str = ""  # the host identity ranks reported (PLAIT_HOST_ID or hostname/...)


@dataclass(frozen=True)
class Topology:
    hosts: tuple[Host, ...]
    ranks: tuple[RankInfo, ...]
    links: Mapping[str, LinkClass] = field(default_factory=dict)
    source: str = "discovery"

    # -- queries --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.ranks)

    def host_of(self, rank: int) -> Host:
        name = self.ranks[rank].host
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def local_size(self) -> int:
        """The number of ranks per host if every host has the same number, else 0."""
        sizes = {len(h.ranks) for h in self.hosts}
        return sizes.pop() if len(sizes) == 1 else 0

    def rails(self) -> int:
        """Rails every host has (the minimum over hosts; 0 where none are known)."""
        return min((len(h.rails) for h in self.hosts), default=0)

    def switch_of(self, host: Host) -> str:
        return host.switch or host.rack or ""

    def switches(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for h in self.hosts:
            out.setdefault(self.switch_of(h), []).append(h.name)
        return out

    def link(self, cls: str) -> LinkClass:
        return self.links.get(cls, LinkClass())

    def rail_bandwidth(self) -> float | None:
        """The slowest known rail bandwidth (bit/s), else the slowest interface speed of
        a rail, else None."""
        bws = [r.bandwidth for h in self.hosts for r in h.rails if r.bandwidth]
        return min(bws) if bws else None

    # -- serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "size": self.size,
            "hosts": [{
                "name": h.name, "identity": h.identity, "switch": h.switch, "rack": h.rack,
                "ranks": [asdict(self.ranks[r]) for r in h.ranks],
                "rails": [asdict(r) for r in h.rails],
                "interfaces": [{**asdict(i), "addresses": list(i.addresses)}
                               for i in h.interfaces],
            } for h in self.hosts],
            "links": {k: asdict(v) for k, v in self.links.items()},
        }


def synthetic(switches: int, hosts_per_switch: int, ranks_per_host: int, *, rails: int = 1,
              placement: str = "block", bandwidth: float = 100e9) -> Topology:
    """A made-up topology for tests and predictions: ``placement="block"`` numbers ranks
    host by host, ``"cyclic"`` deals them round-robin over the hosts (as a careless
    launcher might)."""
    nh = switches * hosts_per_switch
    n = nh * ranks_per_host
    host_of = [r // ranks_per_host if placement == "block" else r % nh for r in range(n)]
    per_host: list[list[int]] = [[] for _ in range(nh)]
    for r in range(n):
        per_host[host_of[r]].append(r)
    hosts = tuple(Host(f"s{h // hosts_per_switch}h{h % hosts_per_switch}", tuple(per_host[h]),
                       switch=f"s{h // hosts_per_switch}",
                       rails=tuple(Rail(f"rail{i}", None, bandwidth) for i in range(rails)))
                  for h in range(nh))
    ranks = tuple(RankInfo(r, hosts[host_of[r]].name, per_host[host_of[r]].index(r),
                           ranks_per_host, rail=per_host[host_of[r]].index(r) % rails)
                  for r in range(n))
    return Topology(hosts, ranks, {}, source="synthetic")


def build(infos: Sequence[Mapping[str, Any]], file: Any = None) -> Topology:
    """The job's topology from every rank's discovery info (``discover.local_info``), in
    rank order, and an optional parsed topology file (``file.TopoFile``)."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        ident = str(info["host"])
        if ident not in members:
            order.append(ident)
            members[ident] = []
        members[ident].append(r)
    hosts: list[Host] = []
    name_of: dict[str, str] = {}
    for ident in order:
        ranks = members[ident]
        first = infos[ranks[0]]
        spec = file.host_for(ident) if file is not None else None
        ifaces = tuple(Interface(str(i["name"]), tuple(i.get("addrs", ())), i.get("speed"),
                                 bool(i.get("loopback", False)))
                       for i in first.get("ifaces", ()))
        if spec is not None:
            rails = spec.rails
            name, switch, rack = spec.name, spec.switch, spec.rack
        else:
            rails = tuple(_rail_from_discovery(n, ifaces) for n in first.get("rails", ()))
            name, switch, rack = ident, None, None
        name_of[ident] = name
        hosts.append(Host(name, tuple(ranks), switch, rack, rails, ifaces, ident))
    rank_infos = []
    for r, info in enumerate(infos):
        ident = str(info["host"])
        ranks = members[ident]
        lr = ranks.index(r)
        h = hosts[order.index(ident)]
        rank_infos.append(RankInfo(r, name_of[ident], lr, len(ranks), info.get("numa"),
                                   info.get("pid"), lr % len(h.rails) if h.rails else None))
    links = dict(file.links) if file is not None else {}
    source = f"file {file.path}" if file is not None else "discovery"
    return Topology(tuple(hosts), tuple(rank_infos), links, source)


def _rail_from_discovery(name: str, ifaces: tuple[Interface, ...]) -> Rail:
    for i in ifaces:
        if i.name == name:
            return Rail(name, i.addresses[0] if i.addresses else None, i.speed)
    return Rail(name)
