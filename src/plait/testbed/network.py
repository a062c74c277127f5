"""The network of an emulated cluster: its namespaces, veth links, bridges, addresses, tbf
qdiscs and ECMP routes, built and deleted with ``ip``, ``tc`` and ``sysctl``.

:class:`Network` knows only names, addresses and the commands that build or delete them;
:class:`plait.testbed.cluster.Cluster` is the user-facing launcher on top of it (the
layout is drawn in that module's docstring). Every namespace name carries the per-run
prefix, so ``Network.destroy`` finds and deletes even one whose construction failed
half-way.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

from plait.errors import PlaitError
from plait.health import pid_alive

NAME_PREFIX = "plait-"
"""Every namespace this package creates is named ``plait-<pid>-<hex>-<role>``."""

RAIL_NET = "10.77"
"""Rail ``r`` of host ``h`` is ``10.77.<r>.<h+1>/24``."""

HOST_NET = "10.78.0"
"""The host address of host ``h`` (with ``ecmp=True``) is ``10.78.0.<h+1>/32``."""

_RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]?(bit|bps))$", re.IGNORECASE)
_RATE_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class TestbedError(PlaitError):
    """Building, using or tearing down the emulated cluster failed."""

    __test__ = False  # not a pytest test class, despite the name


def _cmd_text(argv: Sequence[str]) -> str:
    return " ".join(argv)


def run_cmd(argv: Sequence[str], *, input_text: str | None = None) -> str:
    """Run one command; on failure raise TestbedError naming the command and its stderr."""
    try:
        proc = subprocess.run(
            list(argv), input=input_text, capture_output=True, text=True, check=True, timeout=30
        )
    except FileNotFoundError as exc:
        raise TestbedError(f"`{_cmd_text(argv)}` failed: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        err = (exc.stderr or "").strip() or (exc.stdout or "").strip() or "(no output)"
        raise TestbedError(
            f"`{_cmd_text(argv)}` failed with exit status {exc.returncode}: {err}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"`{_cmd_text(argv)}` did not finish within 30 s") from exc
    return proc.stdout


def netns_list() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows."""
    out = run_cmd(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def normalise_rates(rate: str | Sequence[str] | None, rails: int) -> list[str | None]:
    """One tc rate (or None: unshaped) per rail, from a rate, a comma list or a sequence."""
    if rate is None:
        return [None] * rails
    items = [r.strip() for r in rate.split(",")] if isinstance(rate, str) else list(rate)
    if len(items) == 1:
        items = items * rails
    if len(items) != rails:
        raise ValueError(f"rate: got {len(items)} rates for {rails} rails ({rate!r})")
    out: list[str | None] = []
    for item in items:
        if item in ("", "none", None):
            out.append(None)
        elif isinstance(item, str) and _RATE_RE.match(item):
            out.append(item.lower())
        else:
            raise ValueError(f"rate {item!r}: expected a tc rate such as 200mbit or 1gbit")
    return out


def rate_bits(rate: str | None) -> int | None:
    """A tc rate (``200mbit``; tc's ``bps`` means bytes/s) in bits per second."""
    if rate is None:
        return None
    m = _RATE_RE.match(rate)
    if m is None:
        raise ValueError(f"rate {rate!r}: expected a tc rate such as 200mbit or 1gbit")
    unit = m.group(2).lower()  # e.g. "mbit" or "mbps"
    per = 8 if unit.endswith("bps") else 1
    return int(float(rate[: m.start(2)]) * _RATE_SCALE[unit[:-3]] * per)


def kill_netns_pids(name: str) -> None:
    """SIGKILL every process still inside namespace ``name`` (by PID)."""
    res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                         check=False)
    me = os.getpid()
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != me:
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def cleanup_stale() -> list[str]:
    """Delete ``plait-<pid>-...`` namespaces whose creating process no longer exists."""
    removed = []
    for name in netns_list():
        m = re.match(rf"^{re.escape(NAME_PREFIX)}(\d+)-", name)
        if m and not pid_alive(int(m.group(1))):
            kill_netns_pids(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


def probe() -> tuple[bool, str]:
    """Whether this machine can build a network (root, tools, veth, bridge, tbf, sysctl)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not running as root (network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("sysctl", "procps")):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` binary (apt-get install {pkg})"
    name = f"{NAME_PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        run_cmd(["ip", "netns", "add", name])
    except TestbedError as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])
        run_cmd(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        run_cmd(["ip", "-n", name, "link", "add", "b0", "type", "bridge"])
        run_cmd(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
                 "rate", "200mbit", "burst", "64kb", "latency", "50ms"])
        run_cmd(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                 "net.ipv4.fib_multipath_hash_policy=1"])
    except TestbedError as exc:
        return False, f"network namespace lacks a needed feature (veth, bridge, tbf, sysctl): {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return True, "root; ip, tc, veth, bridge, tbf and sysctl work in a network namespace"


class Network:
    """The namespaces, links, addresses, qdiscs and routes of one emulated cluster.

    Hosts are indices ``0..hosts-1`` here (the caller checks them); rail ``r`` of every host
    is shaped to ``rates[r]`` (None: unshaped). Nothing exists until ``build``.
    """

    def __init__(
        self,
        prefix: str,
        hosts: int,
        rates: Sequence[str | None],
        *,
        ecmp: bool,
        burst: str,
        latency: str,
    ) -> None:
        self.prefix = prefix
        self.num_hosts = hosts
        self.rates: list[str | None] = list(rates)
        self.num_rails = len(self.rates)
        self.ecmp = ecmp
        self.burst = burst
        self.latency = latency
        self.hosts: tuple[str, ...] = tuple(f"h{i}" for i in range(hosts))
        self.rail_names: tuple[str, ...] = tuple(f"rail{r}" for r in range(self.num_rails))
        self.switch_ns = f"{prefix}-sw"

    def netns(self, host: int) -> str:
        return f"{self.prefix}-{self.hosts[host]}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this network: the hosts', then the switch's."""
        return [self.netns(h) for h in range(self.num_hosts)] + [self.switch_ns]

    def addr(self, host: int, rail: int) -> str:
        return f"{RAIL_NET}.{rail}.{host + 1}"

    def host_addr(self, host: int) -> str:
        return f"{HOST_NET}.{host + 1}"

    def build(self) -> None:
        """Create everything; on failure whatever exists is left for ``destroy``."""
        sw = self.switch_ns
        run_cmd(["ip", "netns", "add", sw])
        run_cmd(["ip", "-n", sw, "link", "set", "lo", "up"])
        for r in range(self.num_rails):
            run_cmd(["ip", "-n", sw, "link", "add", f"br{r}", "type", "bridge"])
            run_cmd(["ip", "-n", sw, "link", "set", f"br{r}", "up"])
        for h in range(self.num_hosts):
            self._build_host(h)
        if self.ecmp:
            for h in range(self.num_hosts):
                self._add_routes(h)

    def _build_host(self, h: int) -> None:
        ns, sw = self.netns(h), self.switch_ns
        run_cmd(["ip", "netns", "add", ns])
        # No IPv6 (its link-local chatter would share the shaped links); the
        # ephemeral port range is pinned so MASTER_PORT (below it) stays free; no
        # reverse-path filter to second-guess multipath replies.
        run_cmd([
            "ip", "netns", "exec", ns, "sysctl", "-q", "-w",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
            "net.ipv4.ip_local_port_range=32768 60999",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.fib_multipath_hash_policy=1",
        ])
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        for r, rail in enumerate(self.rail_names):
            peer = f"h{h}r{r}"
            # Created inside the host namespace, peer end moved straight into the
            # switch: nothing ever appears in the root namespace.
            run_cmd(["ip", "-n", ns, "link", "add", rail, "type", "veth",
                     "peer", "name", peer, "netns", sw])
            run_cmd(["ip", "-n", sw, "link", "set", peer, "master", f"br{r}"])
            run_cmd(["ip", "-n", sw, "link", "set", peer, "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(h, r)}/24", "dev", rail])
            run_cmd(["ip", "-n", ns, "link", "set", rail, "up"])
            rate = self.rates[r]
            if rate is not None:
                run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", rail, "root", "tbf",
                         "rate", rate, "burst", self.burst, "latency", self.latency])
        if self.ecmp:
            run_cmd(["ip", "-n", ns, "addr", "add", f"{self.host_addr(h)}/32", "dev", "lo"])

    def _add_routes(self, h: int) -> None:
        """One multipath route from host ``h`` to each other host, one next hop per rail."""
        ns = self.netns(h)
        for other in range(self.num_hosts):
            if other == h:
                continue
            argv = ["ip", "-n", ns, "route", "add", f"{self.host_addr(other)}/32",
                    "src", self.host_addr(h)]
            for r, rail in enumerate(self.rail_names):
                argv += ["nexthop", "via", self.addr(other, r), "dev", rail]
            run_cmd(argv)

    def destroy(self) -> list[str]:
        """Delete every namespace carrying this network's prefix; returns what failed.

        Never raises for a namespace that is already gone, and never blocks on a lock, so
        it is safe from a signal handler.
        """
        errors: list[str] = []
        names = set(self.namespaces)
        try:
            # Also those a failed or interrupted build left behind under our prefix.
            names |= {n for n in netns_list() if n.startswith(self.prefix + "-")}
        except TestbedError:
            pass
        # Hosts first, switch last; any process that escaped its group is killed by PID.
        for name in sorted(names, key=lambda n: n == self.switch_ns):
            kill_netns_pids(name)
            res = subprocess.run(["ip", "netns", "del", name], capture_output=True,
                                 text=True, check=False)
            if res.returncode != 0 and "No such file" not in res.stderr:
                errors.append(f"`ip netns del {name}`: {res.stderr.strip()}")
        return errors
