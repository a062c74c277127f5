"""The fabric of one communicator on this rank: its transports (opened in registry order),
a channel per peer, the doorbell its waits sleep on, and the host collective.

For each peer the first transport that can reach it carries its messages
(transport/registry.py). The doorbell is the segment's word of this rank when there are
local peers (peers ring it), else a private one (TCP readers ring it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .config import Config
from .errors import PlaitError
from .executor import Waiter
from .membership import Group, Origin
from .rendezvous import host_identity
from .topology import discover as topo_discover
from .transport import registry
from .transport.base import (
    Channel,
    HostCollective,
    P2PSink,
    PeerState,
    Site,
    Transport,
)
from .transport.futex import Bell, cpu_count, private_bell


def local_info(cfg: Config, host_local_rank: int | None) -> dict[str, Any]:
    """This rank's rendezvous info: host identity, process, discovery (topology)."""
    return {**topo_discover.local_info(cfg.host_id, cfg.socket_ifname),
            "host": host_identity(cfg.host_id), "pid": os.getpid(), "hlr": host_local_rank}


def spin_seconds(cfg: Config, local_ranks: int) -> tuple[float, bool]:
    """(spin before sleeping, whether ranks outnumber cores).

    Spin long enough that a peer a little behind is caught without a futex round trip:
    with a short spin, two ranks fall into a pattern where each waits for the other to
    wake up (measured here: 8-byte allreduce 13 us with a 2 ms spin, 150+ us with 50 us
    under load). Oversubscribed, spin by yielding the core (and for less long)."""
    over = local_ranks > cpu_count()
    spin = cfg.spin_us if cfg.spin_us >= 0 else (500.0 if over else 2000.0)
    return spin * 1e-6, over


class Fabric:
    def __init__(self, group: Group, origin: Origin, uid: bytes, sink: P2PSink,
                 explain_loss: Callable[[int, BaseException], BaseException],
                 lost: dict[int, BaseException], deadline: float) -> None:
        self.group = group
        self.rank = group.rank
        self.spin_s, self.oversubscribed = spin_seconds(origin.cfg, len(group.local_ranks))
        site = Site(rank=group.rank, size=group.size, hosts=group.hosts,
                    local_ranks=group.local_ranks, host_local_rank=group.host_local_rank,
                    cfg=origin.cfg, topology=group.topology, meet=origin.meet, uid=uid,
                    job=origin.job, secret=origin.secret, deadline=deadline,
                    timeout=origin.timeout, sink=sink, explain_loss=explain_loss, lost=lost,
                    spin_s=self.spin_s)
        self.transports: list[Transport] = []
        self.bell: Bell = private_bell()
        self.p2p_bell: Bell = private_bell()
        self.host: HostCollective | None = None
        self._chans: dict[int, Channel] = {}
        self._route: dict[int, Transport] = {}
        try:
            # transports that own the doorbell words first: the others ring them
            for spec in sorted(registry.TRANSPORTS, key=lambda s: not s.makes_bell):
                if spec.makes_bell is False and site.bell is None:
                    site.bell, site.p2p_bell = self.bell, self.p2p_bell
                if spec.wanted(site):
                    t = spec.open(site)
                    self.transports.append(t)
                    if spec.makes_bell:
                        self.bell, self.p2p_bell = t.bell, t.p2p_bell  # type: ignore[attr-defined]
                        site.bell, site.p2p_bell = self.bell, self.p2p_bell
        except BaseException:
            self.close()
            raise
        # the one store on the hot path of a collective (see progress.Sequencer)
        self.mark_done: Callable[[int], None] | None = next(
            (t.mark_done for t in self.transports if t.publishes_progress), None)

    def attach_host(self, waiter: Waiter) -> None:
        """Make the host collective (every rank local, two or more): its waits use
        ``waiter``, which checks this communicator's health."""
        if not self.group.all_local:
            return
        for t in self.transports:
            host = t.host_collective(waiter)
            if host is not None:
                self.host = host
                return

    # -- reaching peers -------------------------------------------------------------------

    def transport_for(self, peer: int) -> Transport:
        t = self._route.get(peer)
        if t is None:
            for cand in self.transports:
                if cand.can_connect(peer):
                    t = self._route[peer] = cand
                    break
            else:
                raise PlaitError(f"rank {self.rank}: no transport reaches rank {peer}")
        return t

    def channel(self, peer: int) -> Channel:
        ch = self._chans.get(peer)
        if ch is None:
            ch = self._chans[peer] = self.transport_for(peer).channel(peer)
        return ch

    def start_p2p(self) -> None:
        for t in self.transports:
            t.start_p2p()

    # -- what diagnostics and tests may ask -------------------------------------------------

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"transports": [t.name for t in self.transports]}
        for t in self.transports:
            info.update(t.describe())
        return info

    # -- health signals (plait.health.Signals) ---------------------------------------------

    def dead_peers(self) -> list[tuple[int, str]]:
        return [d for t in self.transports for d in t.dead_peers()]

    def notices(self) -> list[tuple[int, int]]:
        return [n for t in self.transports for n in t.notices()]

    def publish_notice(self, value: int) -> None:
        for t in self.transports:
            t.publish_notice(value)

    def peer_states(self) -> dict[int, PeerState]:
        out: dict[int, PeerState] = {}
        for t in self.transports:
            out.update(t.peer_states())
        return out

    def mark(self, *, blocked: int | None = None, done: int | None = None) -> None:
        for t in self.transports:
            t.mark(blocked=blocked, done=done)

    # -- closing --------------------------------------------------------------------------

    def close(self, holders: Callable[[], None] | None = None) -> None:
        """Close every transport. ``holders()`` drops what may still hold views into the
        shared-memory segment (a failed operation's traceback); called if a first attempt
        to unmap it fails."""
        self.host = None
        self._chans.clear()
        self._route.clear()
        self.bell, self.p2p_bell = private_bell(), private_bell()
        self.mark_done = None
        # reverse order: TCP readers and senders stop before the segment is unmapped
        for t in reversed(self.transports):
            if not t.close() and holders is not None:
                holders()
                t.close()
        self.transports = []
