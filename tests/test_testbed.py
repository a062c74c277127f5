"""The emulated cluster (plait.testbed): namespaces, rails, shaping, ECMP, launch, teardown.

Every test that builds a cluster skips, with the reason, where this machine cannot create
network namespaces (not root, no iproute2, ...). Traffic goes only to addresses of the
namespaces these tests create, in bounded loops.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import plait
from plait.testbed import Cluster, TestbedError
from plait.testbed import cli as testbed_cli
from plait.testbed.cluster import _normalise_rates, _rate_bits, _run

AVAILABLE, REASON = Cluster.available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=REASON)

PY = sys.executable
# Subprocesses (ranks, the CLI) import plait from where this test run imports it.
PLAIT_ROOT = str(Path(plait.__file__).resolve().parent.parent)
SUB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (PLAIT_ROOT, os.environ.get("PYTHONPATH", "")) if p)}

# A TCP sink/client pair. server: accept N connections on 0.0.0.0:PORT, read each to EOF,
# reply with JSON {peer, bytes}. client: send N bytes to each comma-separated address,
# print JSON per address (local address, seconds from connect to reply). Bounded: 15 s.
NET_SCRIPT = r"""
import json, socket, sys, time
role, where, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + 15
if role == "server":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(8)
    s.settimeout(15)
    for _ in range(n):
        c, peer = s.accept()
        c.settimeout(15)
        total = 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            total += len(b)
        c.sendall(json.dumps({"peer": peer[0], "bytes": total}).encode())
        c.close()
else:
    out = []
    for addr in where.split(","):
        while True:
            try:
                c = socket.create_connection((addr, port), timeout=5)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        c.settimeout(15)
        t0 = time.monotonic()
        c.sendall(b"x" * n)
        c.shutdown(socket.SHUT_WR)
        reply = b""
        while True:
            b = c.recv(4096)
            if not b:
                break
            reply += b
        out.append({"addr": addr, "local": c.getsockname()[0],
                    "seconds": time.monotonic() - t0, **json.loads(reply)})
        c.close()
    print(json.dumps(out))
"""


def _ours() -> list[str]:
    """Namespaces created by this test process (every Cluster here is named after our PID)."""
    prefix = f"plait-{os.getpid()}-"
    return [n for n in _netns_list() if n.startswith(prefix)]


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers() -> Iterator[None]:
    yield
    if AVAILABLE:
        left = _ours()
        for name in left:  # clean up anyway, then fail loudly
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        assert not left, f"namespaces left behind: {left}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not AVAILABLE:
        pytest.skip(REASON)
    with Cluster(hosts=2, rails=2, rate="200mbit,100mbit", ecmp=True) as c:
        yield c


def _transfer(c: Cluster, addrs: list[str], nbytes: int) -> list[dict[str, object]]:
    """Send ``nbytes`` from h0 to each address (all on h1) over TCP; return client reports."""
    port = c.free_port()
    server = c.run("h1", [PY, "-c", NET_SCRIPT, "server", "-", str(port), str(len(addrs))],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = c.run("h0", [PY, "-c", NET_SCRIPT, "client", ",".join(addrs), str(port),
                          str(nbytes)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = client.communicate(timeout=20)
        assert client.returncode == 0, err
        server.communicate(timeout=5)
        assert server.returncode == 0
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports: list[dict[str, object]] = json.loads(out)
    return reports


# ---------------------------------------------------------------- no root needed


def test_available_gives_a_reason() -> None:
    ok, reason = Cluster.available()
    assert isinstance(ok, bool)
    assert reason


def test_rates_are_validated() -> None:
    assert _normalise_rates("200mbit", 2) == ["200mbit", "200mbit"]
    assert _normalise_rates("200mbit,100Mbit", 2) == ["200mbit", "100mbit"]
    assert _normalise_rates(None, 3) == [None, None, None]
    with pytest.raises(ValueError, match="3 rates for 2 rails"):
        _normalise_rates("1mbit,2mbit,3mbit", 2)
    with pytest.raises(ValueError, match="tc rate"):
        _normalise_rates("fast", 1)
    with pytest.raises(ValueError, match="hosts"):
        Cluster(hosts=0)
    assert _rate_bits("200mbit") == 200_000_000
    assert _rate_bits("1.5gbit") == 1_500_000_000
    assert _rate_bits("10mbps") == 80_000_000  # tc's bps is bytes per second
    assert _rate_bits(None) is None


def test_names_and_addresses_without_building() -> None:
    c = Cluster(hosts=3, rails=2, ecmp=True)
    assert c.hosts == ("h0", "h1", "h2")
    assert c.addr("h2", 1) == "10.77.1.3"
    assert c.addr(0) == "10.77.0.1"
    assert c.host_addr(1) == "10.78.0.2"
    assert c.netns("h1") == f"{c.prefix}-h1"
    assert c.prefix.startswith(f"plait-{os.getpid()}-")
    assert c.ifnames == "rail0,rail1"
    env = c.env_for(rank=3, ranks_per_host=2, master_port=12345)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "6"
    assert env["PLAIT_HOST_ID"] == "h1" and env["MASTER_ADDR"] == "10.77.0.1"
    spec = Cluster(hosts=2, rails=2, rate="200mbit,100mbit").spec()
    json.dumps(spec)
    assert [r["rate_bps"] for r in spec["hosts"][1]["rails"]] == [200_000_000, 100_000_000]
    assert spec["hosts"][1]["rails"][0]["addr"] == "10.77.0.2"
    with pytest.raises(ValueError, match="unknown host"):
        c.addr("h9", 0)
    with pytest.raises(TestbedError, match="ecmp=True"):
        Cluster(hosts=2).host_addr(0)
    with pytest.raises(TestbedError, match="not running"):
        c.launch([PY, "-c", "pass"])


def test_failing_command_error_names_command_and_stderr() -> None:
    if not AVAILABLE:
        pytest.skip(REASON)
    with pytest.raises(TestbedError) as info:
        _run(["ip", "link", "show", "dev", "plait-no-such-if"])
    msg = str(info.value)
    assert "ip link show dev plait-no-such-if" in msg
    assert "does not exist" in msg


def test_cli_check() -> None:
    parser = argparse.ArgumentParser()
    testbed_cli.add_arguments(parser)
    assert testbed_cli.run(parser.parse_args(["--check"])) == (0 if AVAILABLE else 1)


# ---------------------------------------------------------------- on a built cluster


@needs_netns
def test_namespaces_and_links_exist(cluster: Cluster) -> None:
    names = _netns_list()
    for ns in cluster.namespaces:
        assert ns in names
    for h in cluster.hosts:
        links = _run(["ip", "-n", cluster.netns(h), "-o", "link", "show"])
        addrs = _run(["ip", "-n", cluster.netns(h), "-o", "-4", "addr", "show"])
        for r, rail in enumerate(cluster.rail_names):
            assert f" {rail}@" in links
            assert f"{cluster.addr(h, r)}/24" in addrs
    for r in range(cluster.num_rails):
        ports = _run(["ip", "-n", cluster.switch_ns, "-o", "link", "show", "master", f"br{r}"])
        assert f"h0r{r}@" in ports and f"h1r{r}@" in ports


@needs_netns
def test_host0_reaches_host1_over_each_rail(cluster: Cluster) -> None:
    addrs = [cluster.addr("h1", r) for r in range(cluster.num_rails)]
    reports = _transfer(cluster, addrs, 64)
    assert [rep["addr"] for rep in reports] == addrs
    for r, rep in enumerate(reports):
        assert rep["bytes"] == 64
        assert rep["local"] == cluster.addr("h0", r)  # left through rail r
        assert rep["peer"] == cluster.addr("h0", r)


@needs_netns
def test_rails_are_shaped(cluster: Cluster) -> None:
    for h in cluster.hosts:
        for rail, rate in (("rail0", "200Mbit"), ("rail1", "100Mbit")):
            out = _run(["tc", "-n", cluster.netns(h), "qdisc", "show", "dev", rail])
            assert "tbf" in out and f"rate {rate}" in out, out
    # 2 MB at 200 Mbit/s (25 MB/s) takes ~80 ms; unshaped veth would take ~2 ms.
    nbytes = 2_000_000
    (rep,) = _transfer(cluster, [cluster.addr("h1", 0)], nbytes)
    assert rep["bytes"] == nbytes
    seconds = float(rep["seconds"])  # type: ignore[arg-type]
    assert 0.04 < seconds < 10, f"{nbytes} B over a 200 Mbit/s rail took {seconds:.3f} s"


@needs_netns
def test_ecmp_routes(cluster: Cluster) -> None:
    ns0 = cluster.netns("h0")
    route = _run(["ip", "-n", ns0, "route", "show", cluster.host_addr("h1")])
    for r, rail in enumerate(cluster.rail_names):
        assert f"nexthop via {cluster.addr('h1', r)} dev {rail}" in route, route
    policy = _run(["ip", "netns", "exec", ns0, "sysctl", "-n",
                   "net.ipv4.fib_multipath_hash_policy"])
    assert policy.strip() == "1"
    (rep,) = _transfer(cluster, [cluster.host_addr("h1")], 64)
    assert rep["bytes"] == 64
    assert rep["local"] == cluster.host_addr("h0")  # the route's src hint
    assert rep["peer"] == cluster.host_addr("h0")


LAUNCH_CODE = """
import json, os
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "PLAIT_HOST_ID", "PLAIT_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "EXTRA"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


@needs_netns
def test_launch_gives_each_rank_its_environment(cluster: Cluster) -> None:
    res = cluster.launch([PY, "-c", LAUNCH_CODE], ranks_per_host=2, env={"EXTRA": "x"},
                         timeout=20).check()
    assert res.returncodes == [0, 0, 0, 0]
    envs = [json.loads(out) for out in res.stdouts]
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, e in enumerate(envs):
        assert e["RANK"] == str(rank)
        assert e["WORLD_SIZE"] == "4"
        assert e["LOCAL_RANK"] == str(rank % 2)
        assert e["LOCAL_WORLD_SIZE"] == "2"
        assert e["PLAIT_HOST_ID"] == f"h{rank // 2}"
        assert e["MASTER_ADDR"] == cluster.addr("h0", 0)
        assert e["PLAIT_SOCKET_IFNAME"] == e["GLOO_SOCKET_IFNAME"] == "rail0,rail1"
        assert e["EXTRA"] == "x"
    # Each rank really runs in its host's namespace: its rail0 address is its host's.
    probe = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
             "s.connect(('10.77.0.254', 9)); print(s.getsockname()[0])")  # no packet sent
    res = cluster.launch([PY, "-c", probe], ranks_per_host=1, timeout=20).check()
    assert [o.strip() for o in res.stdouts] == [cluster.addr("h0", 0), cluster.addr("h1", 0)]


@needs_netns
def test_launch_kills_every_rank_when_one_fails(cluster: Cluster) -> None:
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1': sys.exit(3)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    res = cluster.launch([PY, "-c", code], ranks_per_host=2, timeout=25)
    assert time.monotonic() - t0 < 10
    assert not res.ok and not res.timed_out
    assert res.first_failure == 1
    assert res.returncodes[1] == 3
    assert [r.killed for r in res.ranks] == [True, False, True, True]
    for r in res.ranks:
        assert r.returncode is not None
    with pytest.raises(TestbedError, match=r"rank 1 \(host h0\) failed first, exit status 3"):
        res.check()


@needs_netns
def test_launch_timeout_kills_every_rank(cluster: Cluster) -> None:
    t0 = time.monotonic()
    res = cluster.launch(["sleep", "30"], ranks_per_host=1, timeout=0.5)
    assert time.monotonic() - t0 < 8
    assert res.timed_out and not res.ok
    assert all(r.killed and r.returncode is not None and r.returncode < 0 for r in res.ranks)
    with pytest.raises(TestbedError, match="timed out"):
        res.check()


# ---------------------------------------------------------------- teardown


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of ours counts as gone once reaped; /proc says what it is.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@needs_netns
def test_teardown_after_exception_in_with_block() -> None:
    names: list[str] = []
    proc = None
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(hosts=2, rails=2, rate="200mbit") as c:
            names = c.namespaces
            proc = c.run("h1", ["sleep", "30"])
            assert set(names) <= set(_netns_list())
            raise RuntimeError("boom")
    assert proc is not None and proc.poll() is not None  # killed and reaped
    left = set(names) & set(_netns_list())
    assert not left
    # Closing twice is harmless, and a closed cluster refuses work.
    c.close()
    with pytest.raises(TestbedError, match="not running"):
        c.run("h0", ["true"])


def _wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _netns_pids(prefix: str) -> list[int]:
    pids = []
    for name in _netns_list():
        if name.startswith(prefix):
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                 check=False)
            pids += [int(t) for t in out.stdout.split() if t.isdigit()]
    return pids


def _signal_and_check_cleanup(argv: list[str], sig: int) -> tuple[int, str]:
    """Start argv (which builds a 2-host cluster running `sleep 30`), wait until the sleeps
    run, send ``sig``, and check that the namespaces and the sleeps are gone.

    Returns the exit status and stderr."""
    proc = subprocess.Popen(argv, env=SUB_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    prefix = f"plait-{proc.pid}-"
    try:
        started = _wait_for(lambda: len(_netns_pids(prefix)) >= 2 or proc.poll() is not None,
                            20)
        assert started and proc.poll() is None, proc.communicate(timeout=5)
        sleeps = _netns_pids(prefix)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for name in _netns_list():  # belt and braces: never leave ours behind
            if name.startswith(prefix):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
                pytest.fail(f"namespace {name} left behind")
    assert _wait_for(lambda: all(_gone(pid) for pid in sleeps), 5), sleeps
    return proc.returncode, err


@needs_netns
def test_cli_run_is_torn_down_on_sigint() -> None:
    rc, err = _signal_and_check_cleanup(
        [PY, "-m", "plait.cli.main", "testbed", "--hosts", "2", "--rails", "2",
         "--rate", "200mbit,100mbit", "--ecmp", "--ranks-per-host", "1", "--", "sleep", "30"],
        signal.SIGINT)
    assert rc == 130, err
    assert "torn down" in err


SIGTERM_SCRIPT = """
from plait.testbed import Cluster
with Cluster(hosts=2, rails=1) as c:
    c.launch(["sleep", "30"], ranks_per_host=1, timeout=60)
"""


@needs_netns
def test_library_run_is_torn_down_on_sigterm() -> None:
    rc, err = _signal_and_check_cleanup([PY, "-c", SIGTERM_SCRIPT], signal.SIGTERM)
    assert rc == -signal.SIGTERM, err


@needs_netns
def test_failed_build_names_the_command_and_leaves_nothing() -> None:
    c = Cluster(hosts=2, rails=2, rate="200mbit", burst="not-a-size")
    with pytest.raises(TestbedError) as info:
        c.start()
    msg = str(info.value)
    assert "tc -n" in msg and "tbf" in msg and "not-a-size" in msg
    assert not set(c.namespaces) & set(_netns_list())


@needs_netns
def test_cleanup_stale_removes_namespaces_of_dead_runs() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"plait-{dead.pid}-beef-h0"
    _run(["ip", "netns", "add", name])
    try:
        assert name in Cluster.cleanup_stale()
        assert name not in _netns_list()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
