"""What one rank can learn about its own host: host identity, NUMA node, network
interfaces with their addresses and link speeds.

``local_info`` returns the JSON-ready dict every rank publishes at rendezvous; the
communicator gathers them and builds one ``Topology`` (``model.build``). Discovery is
cached per process: sub-communicators do not walk /sys again.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from typing import Any

from ..rendezvous import host_identity, interface_address

SYS_NET = "/sys/class/net"
SYS_NODE = "/sys/devices/system/node"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def numa_node(root: str = SYS_NODE) -> int | None:
    """The NUMA node of the CPUs this process may run on (the first node that holds the
    lowest allowed CPU), or None where /sys does not say."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        nodes = sorted(int(n[4:]) for n in os.listdir(root)
                       if n.startswith("node") and n[4:].isdigit())
    except (OSError, AttributeError):
        return None
    for n in nodes:
        text = _read(f"{root}/node{n}/cpulist")
        if text and cpus and cpus[0] in parse_cpulist(text):
            return n
    return nodes[0] if nodes else None


def link_speed(name: str, root: str = SYS_NET) -> float | None:
    """Link speed in bit/s from ``/sys/class/net/<name>/speed`` (Mbit/s); None when the
    driver does not report one (virtual links report -1 or fail to read)."""
    text = _read(f"{root}/{name}/speed")
    try:
        mbit = int(text) if text is not None else -1
    except ValueError:
        return None
    return mbit * 1e6 if mbit > 0 else None


def interfaces(root: str = SYS_NET) -> list[dict[str, Any]]:
    """Every interface that is up, with its IPv4 addresses and speed."""
    addrs: dict[str, list[str]] = {}
    try:
        import psutil  # type: ignore[import-untyped]

        for name, items in psutil.net_if_addrs().items():
            addrs[name] = [a.address for a in items if a.family == socket.AF_INET]
    except ImportError:  # psutil is optional: one address per interface through ioctl
        pass
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = sorted(addrs)
    out = []
    for name in names:
        oper = _read(f"{root}/{name}/operstate")
        if oper not in (None, "up", "unknown"):
            continue
        a = addrs.get(name)
        if a is None:
            one = interface_address(name)
            a = [one] if one else []
        out.append({"name": name, "addrs": a, "speed": link_speed(name, root),
                    "loopback": name == "lo" or _read(f"{root}/{name}/type") == "772"})
    return out


@lru_cache(maxsize=8)
def local_info(host_id: str | None, socket_ifname: str) -> dict[str, Any]:
    """This process's discovery info (the pid is added by the caller)."""
    return {
        "host": host_identity(host_id),
        "numa": numa_node(),
        "ifaces": interfaces(),
        "rails": [n.strip() for n in socket_ifname.split(",") if n.strip()],
    }
