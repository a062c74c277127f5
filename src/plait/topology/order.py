"""Orders that follow the topology, and which network links a message crosses.

A ring in rank order over ranks that a launcher dealt round-robin over hosts sends almost
every message across the network, several per host link at once. ``ring_order`` puts the
ranks of one host next to each other and the hosts of one switch next to each other, so
that a ring crosses each host's link once per direction and each switch's uplink once per
direction: at every ring step each network link carries at most one flow per direction
(tests/test_topology.py counts it on 4 switches x 8 hosts x 8 ranks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from ..algorithms.schedule import Recv, Schedule, Send, Step
from ..algorithms.simulate import Flow
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


def relabel(sched: Schedule, order: tuple[int, ...]) -> Schedule:
    """A schedule written for ring positions, with peers renamed to ranks: position p is
    rank ``order[p]``."""
    steps = []
    for st in sched.steps:
        xf: list[Send | Recv] = []
        for x in st.xfers:
            if isinstance(x, Send):
                xf.append(Send(order[x.peer], x.buf, x.off, x.count))
            else:
                xf.append(Recv(order[x.peer], x.buf, x.off, x.count, x.reduce))
        steps.append(Step(st.local, tuple(xf)))
    return Schedule(tuple(steps), sched.tmp, sched.name)


@lru_cache(maxsize=256)
def ring_allreduce(rank: int, size: int, count: int, order: tuple[int, ...]) -> Schedule:
    """The ring allreduce of ``rank`` with the ring running through ``order``."""
    from ..algorithms import allreduce_ring

    return relabel(allreduce_ring.schedule(order.index(rank), size, count), order)


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


def flows_per_link(topo: Topology, flows: Iterable[Flow],
                   ranks: Sequence[int] | None = None) -> dict[tuple[int, Link], int]:
    """How many messages cross each link in each step. ``ranks`` maps the flows' ranks
    (those of a sub-communicator) to the topology's ranks."""
    out: dict[tuple[int, Link], int] = {}
    for f in flows:
        if f.count == 0:
            continue
        s, d = (f.src, f.dst) if ranks is None else (ranks[f.src], ranks[f.dst])
        for link in links(topo, s, d):
            out[(f.step, link)] = out.get((f.step, link), 0) + 1
    return out
