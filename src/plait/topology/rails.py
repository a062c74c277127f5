"""Which address a rank's TCP traffic uses: its rail.

Local rank i (on its host, in the job's world communicator) uses rail i modulo the
host's rails. The rails come from the topology file (an interface and/or an address per
rail), else from ``PLAIT_SOCKET_IFNAME``; the listener binds that address and outgoing
sockets bind it as their source before connecting, so both directions of every
connection of local rank i stay on rail i. Without rails, the listener binds the address
that routes to the rendezvous host and outgoing sockets let the kernel choose.
"""

from __future__ import annotations

from typing import Any

from ..rendezvous import bind_address, interface_address
from .model import Topology


def rail_address(topo: Topology, rank: int, host_local_rank: int, socket_ifname: str,
                 store: Any) -> tuple[str, bool]:
    """(address to bind, whether outgoing sockets bind it too)."""
    host = topo.host_of(rank)
    if host.rails:
        rail = host.rails[host_local_rank % len(host.rails)]
        addr = rail.address or interface_address(rail.ifname)
        if addr is None:
            raise ValueError(f"rank {rank}: rail {rail.ifname!r} of host {host.name!r} has no "
                             "IPv4 address (give one in the topology file, or fix "
                             "PLAIT_SOCKET_IFNAME)")
        return addr, True
    return bind_address(socket_ifname, store, local_rank=host_local_rank), False
