"""Orders that follow the topology, and which network links a message crosses.

A ring in rank order over ranks that a launcher dealt round-robin over hosts sends almost
every message across the network, several per host link at once. ``ring_order`` puts the
ranks of one host next to each other and the hosts of one switch next to each other, so
that a ring crosses each host's link once per direction and each switch's uplink once per
direction: at every ring step each network link carries at most one flow per direction
(tests/test_topology.py counts it on 4 switches x 8 hosts x 8 ranks).

Topology sits below the algorithms: the ring allreduce that follows an order is
``algorithms.allreduce_ring.in_order``, and the count of messages per link and step over
a simulation is ``algorithms.simulate.flows_per_link`` (both read what is here).
"""

from __future__ import annotations

from .model import Host, Topology


def host_order(topo: Topology) -> list[Host]:
    """Hosts grouped by switch (switches in order of their first host), each group in the
    order of the hosts' lowest ranks."""
    by_switch: dict[str, list[Host]] = {}
    for h in sorted(topo.hosts, key=lambda h: min(h.ranks, default=0)):
        by_switch.setdefault(topo.switch_of(h), []).append(h)
    return [h for group in by_switch.values() for h in group]


def ring_order(topo: Topology) -> list[int]:
    """Ranks in ring order: hosts as ``host_order``, each host's ranks by local rank."""
    return [r for h in host_order(topo) for r in sorted(h.ranks)]


Link = tuple[str, str, int]
"""(direction, host or switch name, rail): "up"/"down" for a host's link to its switch,
"spine_up"/"spine_down" for a switch's uplink to the spine."""


def links(topo: Topology, src: int, dst: int) -> list[Link]:
    """The network links a message from ``src`` to ``dst`` crosses (none within a host).
    The sender's rail carries it out, the receiver's rail in."""
    hs, hd = topo.host_of(src), topo.host_of(dst)
    if hs.name == hd.name:
        return []
    rs = topo.ranks[src].rail or 0
    rd = topo.ranks[dst].rail or 0
    out: list[Link] = [("up", hs.name, rs), ("down", hd.name, rd)]
    ss, sd = topo.switch_of(hs), topo.switch_of(hd)
    if ss != sd:
        out += [("spine_up", ss, rs), ("spine_down", sd, rd)]
    return out
