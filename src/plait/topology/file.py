"""The topology file (``PLAIT_TOPO_FILE``): what discovery cannot see, in JSON or TOML.

Schema (docs/TOPOLOGY.md has the full description and an example)::

    [links.shm]            # optional; also links.switch, links.cross_switch
    bandwidth = "80gbit"   # bit/s: a number, or "<n>[k|m|g|t]bit"; "<n>[K|M|G]B/s" in bytes
    latency = "3us"        # seconds: a number, or "<n>(ns|us|ms|s)"

    [[hosts]]
    name = "h0"            # PLAIT_HOST_ID, or the hostname (the part before the first "/"
                           # of plait's host identity)
    switch = "sw0"         # optional: the switch (leaf) this host hangs off
    rack = "r0"            # optional: used as the switch when no switch is given
    rails = [ { ifname = "rail0", address = "10.77.0.1", bandwidth = "200mbit" } ]

Every error names the file, the host and the field.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .model import LINK_CLASSES, LinkClass, Rail


class TopologyFileError(ValueError):
    """An invalid topology file; the message names the file, the host and the field."""


@dataclass(frozen=True)
class HostSpec:
    name: str
    switch: str | None
    rack: str | None
    rails: tuple[Rail, ...]


@dataclass(frozen=True)
class TopoFile:
    path: str
    hosts: tuple[HostSpec, ...]
    links: Mapping[str, LinkClass]

    def host_for(self, identity: str) -> HostSpec | None:
        """The entry for a host identity: its exact name, else its hostname part."""
        short = identity.split("/", 1)[0]
        for h in self.hosts:
            if h.name == identity:
                return h
        for h in self.hosts:
            if h.name == short:
                return h
        return None


_BW = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bit/s|bps|b/s)\s*$", re.IGNORECASE)
_LAT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s)\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_bandwidth(value: Any) -> float:
    """bit/s from a number (bit/s) or ``200mbit``, ``100gbit``, ``10Gbps`` (bits) or
    ``25GB/s``, ``3GBps`` (bytes: an upper-case B)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a bandwidth")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{value!r}: must be positive")
        return float(value)
    if isinstance(value, str):
        m = _BW.match(value)
        if m:
            num, scale, unit = m.groups()
            bits = float(num) * _SCALE[scale.lower()]
            if unit in ("B/s", "Bps"):
                bits *= 8
            if bits <= 0:
                raise ValueError(f"{value!r}: must be positive")
            return bits
    raise ValueError(f"{value!r} is not a bandwidth (a number in bit/s, or e.g. 200mbit, "
                     "100gbit, 25GB/s)")


def parse_latency(value: Any) -> float:
    """Seconds from a number (seconds) or ``5us``, ``0.2ms``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a latency")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{value!r}: must not be negative")
        return float(value)
    if isinstance(value, str):
        m = _LAT.match(value)
        if m:
            return float(m.group(1)) * _TIME[m.group(2)]
    raise ValueError(f"{value!r} is not a latency (seconds, or e.g. 5us, 0.2ms)")


def _err(path: str, where: str, msg: str) -> TopologyFileError:
    return TopologyFileError(f"topology file {path}: {where}: {msg}")


def _keys(path: str, where: str, obj: Any, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise _err(path, where, f"expected a table/object, got {type(obj).__name__}")
    for k in obj:
        if k not in allowed:
            raise _err(path, where, f"unknown field {k!r} (allowed: {', '.join(allowed)})")
    return obj


def _opt_str(path: str, where: str, obj: Mapping[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _err(path, f"{where}: field {key!r}", f"expected a non-empty string, got {v!r}")
    return v


def parse(data: Any, path: str = "<data>") -> TopoFile:
    """Validate a decoded file (dict) and return its TopoFile."""
    top = _keys(path, "top level", data, ("hosts", "links"))
    links: dict[str, LinkClass] = {}
    raw_links = top.get("links", {})
    for cls, spec in _keys(path, "links", raw_links, LINK_CLASSES).items():
        where = f"links.{cls}"
        spec = _keys(path, where, spec, ("bandwidth", "latency"))
        try:
            bw = parse_bandwidth(spec["bandwidth"]) if "bandwidth" in spec else None
        except ValueError as exc:
            raise _err(path, f"{where}: field 'bandwidth'", str(exc)) from None
        try:
            lat = parse_latency(spec["latency"]) if "latency" in spec else None
        except ValueError as exc:
            raise _err(path, f"{where}: field 'latency'", str(exc)) from None
        links[cls] = LinkClass(bw, lat)
    hosts_raw = top.get("hosts")
    if not isinstance(hosts_raw, list) or not hosts_raw:
        raise _err(path, "field 'hosts'", "expected a non-empty list of hosts")
    hosts: list[HostSpec] = []
    seen: set[str] = set()
    for i, h in enumerate(hosts_raw):
        name = h.get("name") if isinstance(h, Mapping) else None
        where = f"host {name!r}" if isinstance(name, str) and name else f"hosts[{i}]"
        h = _keys(path, where, h, ("name", "switch", "rack", "rails"))
        if not isinstance(name, str) or not name:
            raise _err(path, f"{where}: field 'name'", "expected a non-empty string")
        if name in seen:
            raise _err(path, f"{where}: field 'name'", "host listed twice")
        seen.add(name)
        switch = _opt_str(path, where, h, "switch")
        rack = _opt_str(path, where, h, "rack")
        rails_raw = h.get("rails", [])
        if not isinstance(rails_raw, list):
            raise _err(path, f"{where}: field 'rails'", "expected a list of rails")
        rails = []
        for j, r in enumerate(rails_raw):
            rw = f"{where}: rails[{j}]"
            r = _keys(path, rw, r, ("ifname", "address", "bandwidth"))
            ifname = r.get("ifname")
            if not isinstance(ifname, str) or not ifname:
                raise _err(path, f"{rw}: field 'ifname'", "expected an interface name")
            addr = r.get("address")
            if addr is not None:
                try:
                    addr = str(ipaddress.IPv4Address(addr))
                except (ValueError, TypeError):
                    raise _err(path, f"{rw}: field 'address'",
                               f"{addr!r} is not an IPv4 address") from None
            bw = None
            if "bandwidth" in r:
                try:
                    bw = parse_bandwidth(r["bandwidth"])
                except ValueError as exc:
                    raise _err(path, f"{rw}: field 'bandwidth'", str(exc)) from None
            rails.append(Rail(ifname, addr, bw))
        hosts.append(HostSpec(name, switch, rack, tuple(rails)))
    return TopoFile(path, tuple(hosts), links)


def loads(text: str, path: str = "<text>", fmt: str | None = None) -> TopoFile:
    """Parse JSON or TOML text (``fmt`` "json"/"toml"; by default by the path's suffix,
    else JSON when the text starts with ``{``)."""
    if fmt is None:
        low = path.lower()
        fmt = "toml" if low.endswith(".toml") else "json" if low.endswith(".json") else (
            "json" if text.lstrip().startswith("{") else "toml")
    try:
        if fmt == "json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise TopologyFileError(f"topology file {path}: not valid {fmt.upper()}: {exc}") \
            from None
    return parse(data, path)


def load(path: str) -> TopoFile:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TopologyFileError(f"topology file {path}: cannot read it: {exc}") from None
    return _load_cached(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime: int, size: int) -> TopoFile:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyFileError(f"topology file {path}: cannot read it: {exc}") from None
    return loads(text, path)


def from_cluster_spec(spec: Mapping[str, Any], *, host_address: bool = False,
                      latency: str = "50us") -> dict[str, Any]:
    """A topology file (as a dict, JSON-ready) describing an emulated cluster from
    ``plait.testbed.Cluster.spec()``: its rails with their tbf rates, one switch. With
    ``host_address`` each host has one rail instead: its ECMP host address on ``lo``, at
    the rails' combined rate (so that TCP between hosts goes over ECMP)."""
    hosts = []
    for h in spec["hosts"]:
        rails = [{"ifname": r["ifname"], "address": r["addr"],
                  **({"bandwidth": r["rate_bps"]} if r.get("rate_bps") else {})}
                 for r in h["rails"]]
        if host_address:
            total = sum(r.get("bandwidth", 0) for r in rails)
            rails = [{"ifname": "lo", "address": h["host_addr"],
                      **({"bandwidth": total} if total else {})}]
        hosts.append({"name": h["name"], "switch": "sw0", "rails": rails})
    bws = [r["rate_bps"] for h in spec["hosts"] for r in h["rails"] if r.get("rate_bps")]
    links: dict[str, Any] = {"switch": {"latency": latency}}
    if bws:
        links["switch"]["bandwidth"] = min(bws)
    return {"hosts": hosts, "links": links}
