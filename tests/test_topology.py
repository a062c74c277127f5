"""Topology: the file (parsing, validation), discovery on this machine, the job topology
built from every rank's info, ring orders and rail-aligned phases that keep every network
link to one flow per direction per step (counted by the schedule simulator over synthetic
topologies), and the cost model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from plait.algorithms import allreduce_ring
from plait.algorithms.simulate import flows_per_link, simulate
from plait.topology import discover, synthetic
from plait.topology.file import TopologyFileError, from_cluster_spec, loads, parse_bandwidth
from plait.topology.model import build
from plait.topology.order import host_order, ring_order
from plait.tuning import cost, selector

TOML = """
[links.switch]
bandwidth = "200mbit"
latency = "50us"
[links.cross_switch]
bandwidth = "100gbit"

[[hosts]]
name = "h0"
switch = "sw0"
rails = [ { ifname = "rail0", address = "10.77.0.1", bandwidth = "200mbit" },
          { ifname = "rail1", address = "10.77.1.1", bandwidth = 100e6 } ]

[[hosts]]
name = "h1"
rack = "r1"
rails = [ { ifname = "rail0" } ]
"""


def test_file_toml_and_json_agree() -> None:
    t = loads(TOML, "x.toml")
    assert [h.name for h in t.hosts] == ["h0", "h1"]
    assert t.hosts[0].rails[1].bandwidth == 100e6
    assert t.hosts[0].rails[0].bandwidth == 200e6
    assert t.links["switch"].latency == pytest.approx(50e-6)
    assert t.links["cross_switch"].bandwidth == 100e9
    assert t.hosts[1].rack == "r1" and t.hosts[1].switch is None
    import tomllib

    j = loads(json.dumps(tomllib.loads(TOML)), "x.json")
    assert j.hosts == t.hosts and dict(j.links) == dict(t.links)
    assert t.host_for("h1/bootid/42") is t.hosts[1]  # hostname part of a host identity
    assert t.host_for("h9") is None


@pytest.mark.parametrize(("text", "names"), [
    ('{"hosts": []}', ["hosts", "non-empty"]),
    ('{"hosts": [{"name": "a", "rails": [{"ifname": "e0", "address": "10.0.0.300"}]}]}',
     ["host 'a'", "rails[0]", "address"]),
    ('{"hosts": [{"name": "a", "rails": [{"ifname": "e0", "bandwidth": "fast"}]}]}',
     ["host 'a'", "rails[0]", "bandwidth"]),
    ('{"hosts": [{"name": "a", "rails": [{"address": "10.0.0.1"}]}]}',
     ["host 'a'", "ifname"]),
    ('{"hosts": [{"name": "a", "swtich": "s"}]}', ["host 'a'", "swtich"]),
    ('{"hosts": [{"name": "a"}, {"name": "a"}]}', ["host 'a'", "twice"]),
    ('{"hosts": [{"switch": "s"}]}', ["hosts[0]", "name"]),
    ('{"hosts": [{"name": "a"}], "links": {"switch": {"latency": "soon"}}}',
     ["links.switch", "latency"]),
    ('{"hosts": [{"name": "a"}], "links": {"wan": {}}}', ["links", "wan"]),
    ('{"hosts": [', ["not valid JSON"]),
])
def test_file_errors_name_the_host_and_field(text: str, names: list[str]) -> None:
    with pytest.raises(TopologyFileError) as ei:
        loads(text, "bad.json")
    msg = str(ei.value)
    assert "bad.json" in msg
    for n in names:
        assert n in msg, msg


def test_bandwidth_units() -> None:
    assert parse_bandwidth("25GB/s") == 200e9
    assert parse_bandwidth("10gbit") == 10e9
    assert parse_bandwidth(1e9) == 1e9
    with pytest.raises(ValueError):
        parse_bandwidth(-1)


def test_discovery_on_this_machine() -> None:
    info = discover.local_info(None, "lo")
    assert info["host"] and info["rails"] == ["lo"]
    names = {i["name"]: i for i in info["ifaces"]}
    assert "lo" in names and names["lo"]["loopback"] and "127.0.0.1" in names["lo"]["addrs"]
    assert info["numa"] is None or info["numa"] >= 0
    assert discover.parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    topo = build([{**info, "pid": 1}, {**info, "pid": 2}])
    assert [r.local_rank for r in topo.ranks] == [0, 1] and topo.local_size() == 2
    assert topo.hosts[0].rails[0].address == "127.0.0.1"


def test_build_from_file_and_infos() -> None:
    f = loads(TOML, "x.toml")
    infos = [{"host": h, "pid": 10 + r, "numa": 0, "ifaces": []}
             for r, h in enumerate(["h0", "h1", "h0", "h1"])]
    topo = build(infos, f)
    assert [h.name for h in topo.hosts] == ["h0", "h1"]
    assert topo.hosts[0].ranks == (0, 2) and topo.ranks[2].local_rank == 1
    assert topo.ranks[2].rail == 1 and topo.ranks[3].rail == 0  # h1 has a single rail
    assert topo.rails() == 1 and topo.rail_bandwidth() == 100e6
    assert ring_order(topo) == [0, 2, 1, 3]
    d = topo.to_dict()
    assert d["hosts"][0]["rails"][0]["address"] == "10.77.0.1"
    json.dumps(d)


def test_cluster_spec_to_file() -> None:
    spec = {"hosts": [{"name": f"h{h}", "host_addr": f"10.78.0.{h + 1}",
                       "rails": [{"ifname": f"rail{r}", "addr": f"10.77.{r}.{h + 1}",
                                  "rate_bps": rate} for r, rate in enumerate((200e6, 100e6))]}
                      for h in range(2)]}
    t = loads(json.dumps(from_cluster_spec(spec)), "c.json")
    assert t.hosts[1].rails[1].address == "10.77.1.2"
    e = loads(json.dumps(from_cluster_spec(spec, host_address=True)), "e.json")
    assert e.hosts[0].rails[0].address == "10.78.0.1" and e.hosts[0].rails[0].bandwidth == 300e6


# ----------------------------------------------------------------- flows per link per step


def _max_flows(topo, flows, ranks=None) -> int:  # type: ignore[no-untyped-def]
    counts = flows_per_link(topo, flows, ranks)
    return max(counts.values(), default=0)


def _ring_flows(topo, order):  # type: ignore[no-untyped-def]
    n = topo.size
    scheds = [allreduce_ring.in_order(r, n, n, tuple(order)) for r in range(n)]
    bufs = [np.arange(n, dtype=np.int64) + r for r in range(n)]
    flows = simulate(scheds, bufs, bufs, lambda d, s: np.add(d, s, out=d), in_place=True)
    expect = sum(np.arange(n) + r for r in range(n))
    assert all((b == expect).all() for b in bufs)
    return flows


def test_ring_order_one_flow_per_link_per_step() -> None:
    """4 switches x 8 hosts x 8 ranks, ranks dealt round-robin over the hosts: the ring in
    topology order crosses every link at most once per direction per step; in rank order
    it would pile up to 8 flows on a host link."""
    topo = synthetic(4, 8, 8, placement="cyclic")
    order = ring_order(topo)
    assert sorted(order) == list(range(topo.size))
    assert _max_flows(topo, _ring_flows(topo, order)) == 1
    naive = [(r, r + 1) for r in range(topo.size - 1)]
    from plait.algorithms.simulate import Flow

    assert _max_flows(topo, [Flow(a, b, 1, 0) for a, b in naive]) == 8


def test_rail_phase_one_flow_per_link_per_step() -> None:
    """The inter-host phase of a hierarchical allreduce: 8 rail rings (local rank i of
    every host, hosts in switch order) at once; each rail's links carry one flow per
    direction per step, and so do the switches' uplinks."""
    topo = synthetic(4, 8, 8, rails=8, placement="cyclic")
    hosts = host_order(topo)
    H = len(hosts)
    all_flows = []
    for i in range(8):
        members = [sorted(h.ranks)[i] for h in hosts]
        scheds = [allreduce_ring.schedule(p, H, 4 * H) for p in range(H)]
        # exact data that depends on position and index: a misplaced chunk changes a sum
        bufs = [np.arange(4 * H, dtype=np.int64) * 1009 + p * 7919 for p in range(H)]
        want = sum(np.arange(4 * H, dtype=np.int64) * 1009 + p * 7919 for p in range(H))
        flows = simulate(scheds, bufs, bufs, lambda d, s: np.add(d, s, out=d), in_place=True)
        assert all((b == want).all() for b in bufs)
        assert _max_flows(topo, flows, members) == 1
        all_flows += [(f, members) for f in flows]
    counts: dict = {}
    for f, members in all_flows:
        for k, v in flows_per_link(topo, [f], members).items():
            counts[k] = counts.get(k, 0) + v
    assert max(counts.values()) == 1  # rails do not share links either


# --------------------------------------------------------------------------- cost model


def _sit(hosts: int, local: int, bw: float = 200e6, rails: int = 2) -> selector.Situation:
    model = cost.Model(cost.DEFAULT_SHM, cost.Link(50e-6, 8 / bw), cost.Link(100e-6, 8 / bw))
    return selector.Situation(hosts * local, hosts == 1, hosts > 1, 64 << 10, hosts, local,
                              rails, 1, model)


def test_model_monotone_and_sane() -> None:
    sit = _sit(2, 2)
    for op in ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"):
        for algo in [a for a in selector.ALGORITHMS[op] if a != "direct"]:
            ts = [selector.estimate(op, algo, n, sit) for n in (1 << 10, 1 << 16, 1 << 24)]
            assert 0 < ts[0] <= ts[1] <= ts[2], (op, algo, ts)
    # a flat ring of 16 MiB over 4 ranks: 6 steps of 4 MiB, one flow per link: ~1 s
    ring = selector.estimate("allreduce", "ring", 16 << 20, sit)
    assert ring == pytest.approx(6 * (50e-6 + (4 << 20) * 8 / 200e6), rel=0.01)
    hier = selector.estimate("allreduce", "hier", 16 << 20, sit)
    assert hier < ring / 2.5  # rail-aligned: each rail carries a quarter as much, in parallel


def test_selector_picks_hier_by_model_and_obeys_overrides() -> None:
    sit = _sit(2, 2)
    d = selector.choose("allreduce", 16 << 20, sit)
    assert d.algo == "hier" and d.source == "default" and len(d.estimates) == 2
    assert selector.choose("alltoall", 16 << 20, sit).algo == "hier"
    assert selector.choose("allreduce", 16 << 20, sit, "allreduce:ring").algo == "ring"
    flat = _sit(2, 1)  # one rank per host: nothing to be hierarchical about
    assert selector.choose("allreduce", 16 << 20, flat).algo == "ring"
    with pytest.raises(ValueError, match="hier needs"):
        selector.choose("allreduce", 1 << 20, flat, "allreduce:hier")
    # hier's phases (composite=False) ignore rules naming hier: what is left applies, or
    # the defaults where nothing is
    phase = dataclasses.replace(sit, composite=False)
    spec = "allreduce:hier;broadcast:0-1K:hier,tree"
    assert selector.choose("allreduce", 16 << 20, phase, spec).algo == "ring"
    d = selector.choose("broadcast", 100, phase, spec)
    assert (d.algo, d.source) == ("tree", "PLAIT_ALGO")


def test_calibration_recovers_alpha_beta(tmp_path: Path) -> None:
    """A bench JSON made by the model itself with known alpha/beta fits back to them."""
    true = cost.Link(7e-6, 1 / 2.5e9)
    model = cost.Model(true, true, true)
    shape = cost.Shape(1, 4)
    rows = []
    for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
        t = cost.flat_time("allreduce", "ring", size, shape, model)
        rows.append({"op": "allreduce", "size": size, "algorithm": "ring", "backend": "plait",
                     "out_of_place": {"time_us": t * 1e6}})
    data = {"rows": rows, "options": {"nranks": 4}, "environment": {}}
    fit = cost.calibrate(data, "shm")
    assert fit.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(true.beta, rel=1e-6)
    p = tmp_path / "b.json"
    p.write_text(json.dumps(data))
    assert cost.main(["calibrate", str(p)]) == 0


def test_plait_topo_alone_and_render(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.cli.main import main
    from plait.cli.topo import render

    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert main(["topo", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["size"] == 1 and d["hosts"][0]["ranks"][0]["local_size"] == 1
    assert main(["topo", "--interfaces"]) == 0
    assert "interface lo" in capsys.readouterr().out
    text = render(synthetic(2, 2, 2, rails=2))
    assert text.count("switch s") == 2 and "rank 7: local 1/2" in text and "rail1" in text
