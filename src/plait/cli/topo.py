"""``plait topo``: print the topology as a tree (switches -> hosts -> ranks -> rails) or as
JSON. Alone it describes this host (this process as rank 0); under a launcher (RANK and
WORLD_SIZE or another launcher's variables set) every rank joins with ``plait.init`` and
rank 0 prints the whole job's topology, gathered at rendezvous."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..config import Config
from ..topology.model import Topology, build


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a tree")
    p.add_argument("--interfaces", action="store_true",
                   help="also list every discovered network interface per host")


def _bw(bits: float | None) -> str:
    if not bits:
        return "?"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def _lat(s: float | None) -> str:
    return "?" if s is None else f"{s * 1e6:g} us"


def render(topo: Topology, interfaces: bool = False) -> str:
    from ..topology.order import host_order

    sw = topo.switches()
    lines = [f"topology ({topo.source}): {len(topo.hosts)} host(s), {topo.size} rank(s), "
             f"{len([s for s in sw if s])} switch(es)"]
    current = None
    for h in host_order(topo):
        s = topo.switch_of(h)
        if s != current:
            current = s
            lines.append(f"switch {s or '(unknown)'}")
        ident = f"  [{h.identity}]" if h.identity and h.identity != h.name else ""
        lines.append(f"  host {h.name}{ident}")
        for r in h.ranks:
            ri = topo.ranks[r]
            rail = h.rails[ri.rail].ifname if ri.rail is not None and h.rails else "-"
            numa = "-" if ri.numa is None else str(ri.numa)
            lines.append(f"    rank {r}: local {ri.local_rank}/{ri.local_size}, numa {numa}, "
                         f"rail {rail}" + (f", pid {ri.pid}" if ri.pid else ""))
        for i, rl in enumerate(h.rails):
            lines.append(f"    rail {i}: {rl.ifname} {rl.address or '-'} {_bw(rl.bandwidth)}")
        if interfaces:
            for itf in h.interfaces:
                lines.append(f"    interface {itf.name}: {', '.join(itf.addresses) or '-'} "
                             f"{_bw(itf.speed)}{' (loopback)' if itf.loopback else ''}")
    for cls, lc in topo.links.items():
        lines.append(f"link {cls}: {_bw(lc.bandwidth)}, latency {_lat(lc.latency)}")
    return "\n".join(lines)


def _launched() -> bool:
    from ..rendezvous import launcher_rank_size

    try:
        launcher_rank_size()
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    comm: Any = None
    if _launched():
        import plait

        comm = plait.init()
        topo = comm.topology
        show = comm.rank == 0
    else:
        from ..topology import discover
        from ..topology.file import load

        info = {**discover.local_info(cfg.host_id, cfg.socket_ifname), "pid": os.getpid()}
        topo = build([info], load(cfg.topo_file) if cfg.topo_file else None)
        show = True
    try:
        if show:
            print(json.dumps(topo.to_dict(), indent=1) if args.json
                  else render(topo, args.interfaces))
    finally:
        if comm is not None:
            comm.barrier()  # rank 0 hosts the store: nobody leaves before all have read it
            comm.close()
    return 0
