"""An emulated multi-host cluster on one Linux machine, built from network namespaces.

Layout (``hosts=2, rails=2``; names carry a per-run prefix such as ``plait-4242-1a2b``)::

    namespace <prefix>-h0          namespace <prefix>-sw            namespace <prefix>-h1
    rail0 10.77.0.1/24 ──veth── h0r0 ┐                 ┌ h1r0 ──veth── rail0 10.77.0.2/24
                                     ├ br0 (rail 0 L2) ┤
    rail1 10.77.1.1/24 ──veth── h0r1 ┐                 ┌ h1r1 ──veth── rail1 10.77.1.2/24
                                     └ br1 (rail 1 L2) ┘
    lo    10.78.0.1/32 (ECMP only)                                      lo 10.78.0.2/32

Every host's rail interface has a ``tbf`` qdisc on egress (its rail's rate), so each
direction of each host-to-switch link is shaped. With ``ecmp=True`` each host also gets a
"host address" on its loopback and one multipath route per other host, one next hop per
rail, hashed on the L4 five-tuple (``fib_multipath_hash_policy=1``): separate TCP flows
between two host addresses spread over the rails like flows over a LAG or ECMP fabric.

Nothing is created in the root namespace: each veth pair is created inside its host
namespace with its peer end moved straight into the switch namespace, so deleting the
namespaces deletes every link. Teardown (``close``) kills every process started through
``run``/``launch`` (and anything else still inside the namespaces, by PID) and deletes
every namespace whose name carries this run's prefix. It runs from ``__exit__``, on a
failed setup, from SIGINT/SIGTERM handlers installed while the cluster exists, and
``atexit``. Only SIGKILL can leave namespaces behind; ``Cluster.cleanup_stale()`` (``plait
testbed --cleanup``) removes those of processes that no longer exist.

All namespaces share one kernel, hostname, boot id and ``/dev/shm``: ranks tell emulated
hosts apart only through ``PLAIT_HOST_ID``, which ``launch`` sets.

The namespaces, links, qdiscs and routes themselves are built and deleted by
:class:`plait.testbed.network.Network`; ``Cluster`` is the launcher on top of it.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import IO, Any

from plait.testbed import network
from plait.testbed.network import (
    HOST_NET,
    NAME_PREFIX,
    RAIL_NET,
    Network,
    TestbedError,
)

# Moved to plait.testbed.network; kept importable from here under their old names (the
# tests import them from this module).
from plait.testbed.network import normalise_rates as _normalise_rates
from plait.testbed.network import rate_bits as _rate_bits
from plait.testbed.network import run_cmd as _run  # noqa: F401

__all__ = [
    "HOST_NET",
    "MAX_HOSTS",
    "MAX_RAILS",
    "NAME_PREFIX",
    "RAIL_NET",
    "Cluster",
    "LaunchResult",
    "RankResult",
    "TestbedError",
]

MAX_HOSTS = 250
MAX_RAILS = 16

# Ports handed out as MASTER_PORT lie below the namespaces' ephemeral range (set explicitly
# to 32768-60999 in every host namespace), so no socket opened with port 0 can take one.
_PORT_LOW, _PORT_HIGH = 20000, 32000


@dataclass(frozen=True)
class RankResult:
    """What one rank of a ``launch`` did."""

    rank: int
    host: str
    local_rank: int
    pid: int
    returncode: int | None
    """Exit status; negative: killed by that signal; None: never reaped (should not happen)."""
    stdout: str
    stderr: str
    killed: bool
    """True when the launcher killed this rank (another rank failed, or the timeout passed)."""


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of ``Cluster.launch``: one entry per rank, in rank order."""

    ranks: tuple[RankResult, ...]
    timed_out: bool
    duration_s: float
    first_failure: int | None
    """The rank that failed first (non-zero exit), or None."""

    @property
    def returncodes(self) -> list[int | None]:
        return [r.returncode for r in self.ranks]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    @property
    def stdouts(self) -> list[str]:
        return [r.stdout for r in self.ranks]

    def summary(self, tail_chars: int = 4000) -> str:
        """A readable report: why the launch failed and each failing rank's output tail."""
        lines = []
        if self.timed_out:
            lines.append(f"launch timed out after {self.duration_s:.1f} s; every rank was killed")
        if self.first_failure is not None:
            r = self.ranks[self.first_failure]
            lines.append(f"rank {r.rank} (host {r.host}) failed first, exit status {r.returncode}")
        for r in self.ranks:
            state = "killed by the launcher" if r.killed else f"exit status {r.returncode}"
            lines.append(f"--- rank {r.rank} (host {r.host}, local rank {r.local_rank}): {state}")
            if r.returncode != 0 or self.timed_out:
                for name, text in (("stdout", r.stdout), ("stderr", r.stderr)):
                    if text.strip():
                        lines.append(f"[{name}]\n{text[-tail_chars:].rstrip()}")
        return "\n".join(lines)

    def check(self) -> LaunchResult:
        """Raise TestbedError with ``summary()`` unless every rank exited 0; else return self."""
        if not self.ok:
            raise TestbedError(self.summary())
        return self


_avail_cache: tuple[bool, str] | None = None


class Cluster:
    """H emulated hosts with R rails each; a context manager.

    >>> with Cluster(hosts=2, rails=2, rate="200mbit") as c:          # doctest: +SKIP
    ...     res = c.launch(["python", "-c", "import os; print(os.environ['RANK'])"], 2)
    ...     res.check()
    """

    def __init__(
        self,
        hosts: int = 2,
        rails: int = 2,
        rate: str | Sequence[str] | None = "200mbit",
        *,
        ecmp: bool = False,
        burst: str = "64kb",
        latency: str = "50ms",
    ) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        if not 1 <= rails <= MAX_RAILS:
            raise ValueError(f"rails must be in 1..{MAX_RAILS}, got {rails}")
        prefix = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.network = Network(prefix, hosts, _normalise_rates(rate, rails), ecmp=ecmp,
                               burst=burst, latency=latency)
        # The same values as the network's, kept as plain attributes: they are public API.
        self.num_hosts = hosts
        self.num_rails = rails
        self.rates: list[str | None] = self.network.rates
        self.ecmp = ecmp
        self.burst = burst
        self.latency = latency
        self.prefix = prefix
        self.hosts: tuple[str, ...] = self.network.hosts
        self.rail_names: tuple[str, ...] = self.network.rail_names
        self.switch_ns = self.network.switch_ns
        self._procs: list[subprocess.Popen[Any]] = []
        self._started = False
        self._closed = False
        self._in_close = False
        self._pending_signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._next_port = _PORT_LOW + secrets.randbelow(_PORT_HIGH - _PORT_LOW - 1000)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ availability

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether this machine can build a cluster, and if not, why not (cached)."""
        global _avail_cache
        if _avail_cache is None:
            _avail_cache = network.probe()
        return _avail_cache

    @staticmethod
    def cleanup_stale() -> list[str]:
        """Delete ``plait-<pid>-...`` namespaces whose creating process no longer exists."""
        return network.cleanup_stale()

    # ------------------------------------------------------------------ naming

    def _index(self, host: str | int) -> int:
        if isinstance(host, int) and not isinstance(host, bool):
            if 0 <= host < self.num_hosts:
                return host
        elif isinstance(host, str) and host in self.hosts:
            return self.hosts.index(host)
        raise ValueError(f"unknown host {host!r}: this cluster has hosts {', '.join(self.hosts)}")

    def netns(self, host: str | int) -> str:
        """The network namespace name of ``host`` (a name such as ``h0``, or an index)."""
        return self.network.netns(self._index(host))

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster: the hosts', then the switch's."""
        return self.network.namespaces

    def addr(self, host: str | int, rail: int = 0) -> str:
        """IPv4 address of ``host``'s interface on ``rail`` (no prefix length)."""
        if not 0 <= rail < self.num_rails:
            raise ValueError(f"rail must be in 0..{self.num_rails - 1}, got {rail}")
        return self.network.addr(self._index(host), rail)

    def host_addr(self, host: str | int) -> str:
        """The host address of ``host`` (only with ``ecmp=True``): reached over every rail."""
        if not self.ecmp:
            raise TestbedError("host addresses exist only on a cluster built with ecmp=True")
        return self.network.host_addr(self._index(host))

    @property
    def ifnames(self) -> str:
        """The rail interface list, as PLAIT_SOCKET_IFNAME/GLOO_SOCKET_IFNAME take it."""
        return ",".join(self.rail_names)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> Cluster:
        """Build every namespace, link, address, qdisc and route; tear down on any failure."""
        if self._started:
            raise TestbedError(f"cluster {self.prefix} was already started")
        ok, reason = Cluster.available()
        if not ok:
            raise TestbedError(f"cannot build an emulated cluster here: {reason}")
        self._started = True
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self.network.build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process in the cluster and delete every namespace of this run.

        Idempotent; safe from signal handlers (never blocks on a lock or a Popen.wait).
        """
        if self._closed or self._in_close or not self._started:
            return
        self._in_close = True
        errors: list[str] = []
        try:
            _kill_procs(self._procs, grace_s=1.0)
            errors = self.network.destroy()
            self._closed = True
        finally:
            self._in_close = False
            self._restore_signal_handlers()
            atexit.unregister(self.close)
        pending, self._pending_signal = self._pending_signal, None
        if errors:
            raise TestbedError("teardown failed: " + "; ".join(errors))
        if pending is not None:
            signal.raise_signal(pending)

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may; __exit__ and atexit still clean up
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._in_close:
            self._pending_signal = signum  # re-raised once teardown has finished
            return
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        try:
            self.close()  # restores the previous handlers
        finally:
            if old is None:
                old = signal.SIG_DFL  # a handler installed from C: treat as the default
            if callable(old):
                old(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
            elif old == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)  # die of it, as without the cluster

    # ------------------------------------------------------------------ processes

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise TestbedError(f"cluster {self.prefix} is not running (use it as `with Cluster()`)")

    def run(
        self,
        host: str | int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace (``ip netns exec``); returns its Popen.

        ``env`` is added to this process's environment. The process always leads a new
        session (its PID is its process group, so killing it by PID also reaches its
        children), and ``close`` kills it if it is still running.
        """
        self._check_running()
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, not a string")
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        popen_kwargs["start_new_session"] = True
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.netns(host), *argv], env=full_env, **popen_kwargs
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def free_port(self) -> int:
        """A TCP port no socket in the cluster uses: below the ephemeral range, never reused."""
        with self._lock:
            port = self._next_port
            self._next_port += 1
            if self._next_port >= _PORT_HIGH:
                self._next_port = _PORT_LOW
        return port

    def env_for(self, rank: int, ranks_per_host: int, master_port: int) -> dict[str, str]:
        """The environment ``launch`` gives ``rank`` (torchrun's variables plus plait's)."""
        host, local = divmod(rank, ranks_per_host)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.num_hosts * ranks_per_host),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(ranks_per_host),
            "GROUP_RANK": str(host),
            "NODE_RANK": str(host),
            "MASTER_ADDR": self.addr(0, 0),
            "MASTER_PORT": str(master_port),
            "PLAIT_HOST_ID": self.hosts[host],
            "PLAIT_SOCKET_IFNAME": self.ifnames,
            "GLOO_SOCKET_IFNAME": self.ifnames,
        }

    def launch(
        self,
        argv: Sequence[str],
        ranks_per_host: int = 1,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 120.0,
        *,
        capture: bool = True,
        per_rank_env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> LaunchResult:
        """Run ``argv`` as ``ranks_per_host`` ranks on every host and wait for all of them.

        Rank ``r`` runs on host ``r // ranks_per_host``. Each rank's environment is this
        process's, then ``env_for(...)`` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT, PLAIT_HOST_ID, PLAIT_SOCKET_IFNAME, GLOO_SOCKET_IFNAME),
        then ``env``, then ``per_rank_env[rank]``. If a rank exits non-zero, or ``timeout``
        seconds pass, every other rank is killed (by process group: its PID). Output is
        captured per rank unless ``capture=False`` (then it goes to this process's
        stdout/stderr). Returns a LaunchResult; call ``.check()`` to raise on failure.
        """
        self._check_running()
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, not a string")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        port = self.free_port()
        world = self.num_hosts * ranks_per_host
        procs: list[subprocess.Popen[Any]] = []
        files: list[tuple[IO[bytes], IO[bytes]] | None] = []
        killed: set[int] = set()
        timed_out = False
        first_failure: int | None = None
        t0 = time.monotonic()
        try:
            for rank in range(world):
                renv = self.env_for(rank, ranks_per_host, port)
                if env:
                    renv.update(env)
                if per_rank_env and rank in per_rank_env:
                    renv.update(per_rank_env[rank])
                if capture:
                    out = tempfile.TemporaryFile()
                    err = tempfile.TemporaryFile()
                    files.append((out, err))
                    proc = self.run(rank // ranks_per_host, argv, renv, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL)
                else:
                    files.append(None)
                    proc = self.run(rank // ranks_per_host, argv, renv, stdin=subprocess.DEVNULL)
                procs.append(proc)
            deadline = None if timeout is None else t0 + timeout
            first_failure, killed, timed_out = _wait_ranks(procs, deadline)
        finally:
            _kill_procs(procs, grace_s=1.0)
            with self._lock:
                self._procs = [p for p in self._procs if p not in procs]
        results = _rank_results(procs, files, killed, self.hosts, ranks_per_host)
        return LaunchResult(results, timed_out, time.monotonic() - t0, first_failure)

    def spec(self) -> dict[str, Any]:
        """The cluster as plain data (JSON-ready): hosts, namespaces, rails, rates in bit/s.

        Meant for tools that describe a topology (e.g. to write a PLAIT_TOPO_FILE); the
        rates are the tbf rates, i.e. each host's egress bandwidth on that rail.
        """
        return {
            "prefix": self.prefix,
            "switch_netns": self.switch_ns,
            "ecmp": self.ecmp,
            "hosts": [
                {
                    "name": name,
                    "netns": self.netns(h),
                    "host_addr": self.host_addr(h) if self.ecmp else None,
                    "rails": [
                        {
                            "ifname": rail,
                            "addr": self.addr(h, r),
                            "prefixlen": 24,
                            "rate_bps": _rate_bits(self.rates[r]),
                        }
                        for r, rail in enumerate(self.rail_names)
                    ],
                }
                for h, name in enumerate(self.hosts)
            ],
        }

    def describe(self) -> str:
        """A human-readable summary of the cluster: hosts, namespaces, addresses, rates."""
        lines = [f"emulated cluster {self.prefix}: {self.num_hosts} hosts x "
                 f"{self.num_rails} rails (switch namespace {self.switch_ns})"]
        for h, name in enumerate(self.hosts):
            rails = ", ".join(
                f"{rail} {self.addr(h, r)}" + (f" @{self.rates[r]}" if self.rates[r] else "")
                for r, rail in enumerate(self.rail_names)
            )
            extra = f", host address {self.host_addr(h)} (ECMP)" if self.ecmp else ""
            lines.append(f"  {name}: netns {self.netns(h)}: {rails}{extra}")
        return "\n".join(lines)


def _kill_procs(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM each live process group, then SIGKILL what remains after ``grace_s``.

    Uses only ``poll`` (never ``wait``), so it cannot deadlock inside a signal handler
    that interrupted a ``wait`` on the same Popen.
    """
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.01)
        live = [p for p in live if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:
        time.sleep(0.01)
        live = [p for p in live if p.poll() is None]
    # Reap the leaders' groups' remains too: a group outlives its leader.
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)


def _wait_ranks(procs: Sequence[subprocess.Popen[Any]], deadline: float | None
                ) -> tuple[int | None, set[int], bool]:
    """Poll until every rank has exited, one has failed, or ``deadline`` passes:
    (first failed rank, ranks still running and to be killed, timed out)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if all(c is not None for c in codes):
            return failed, set(), False
        running = {i for i, c in enumerate(codes) if c is None}
        if failed is not None:
            return failed, running, False
        if deadline is not None and time.monotonic() >= deadline:
            return None, running, True
        time.sleep(0.01)


def _rank_results(procs: Sequence[subprocess.Popen[Any]],
                  files: Sequence[tuple[IO[bytes], IO[bytes]] | None], killed: set[int],
                  hosts: Sequence[str], ranks_per_host: int) -> tuple[RankResult, ...]:
    results = []
    for rank, proc in enumerate(procs):
        stdout = stderr = ""
        pair = files[rank]
        if pair is not None:
            texts = []
            for f in pair:
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
                f.close()
            stdout, stderr = texts
        results.append(RankResult(
            rank=rank, host=hosts[rank // ranks_per_host],
            local_rank=rank % ranks_per_host, pid=proc.pid, returncode=proc.returncode,
            stdout=stdout, stderr=stderr,
            # Killed only if our signal ended it, not if it exited by itself meanwhile.
            killed=rank in killed and (proc.returncode or 0) < 0,
        ))
    return tuple(results)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
