"""Every collective on an emulated cluster (plait.testbed): 2 hosts x 2 ranks, 2 rails.

One launch: each rank makes two communicators (hierarchical algorithms forced, then the
defaults), runs every collective at several sizes and checks its result exactly against
the reference, then reports its transports and the addresses its sockets use. TCP must
connect the emulated hosts and shared memory the ranks of one host; local rank i must
listen on, and send from, rail i (given by the topology file); frames are small, so that
large messages are striped over several sockets per peer. Skips with the reason where
namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import plait
from plait.testbed import Cluster
from plait.topology.file import from_cluster_spec

AVAILABLE, REASON = Cluster.available()
TESTS = str(Path(__file__).resolve().parent)
PLAIT_ROOT = str(Path(plait.__file__).resolve().parent.parent)

RANK_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.environ["TESTS_DIR"])
import plait
from plait.rendezvous import store_from_env
from test_collectives import case_ops

OPS = ["allreduce", "broadcast", "allgather", "allgatherv", "reduce_scatter", "alltoall",
       "alltoallv", "reduce", "gather", "scatter", "sendrecv", "barrier"]
HIER = "allreduce:hier;broadcast:hier;allgather:hier;reduce_scatter:hier;alltoall:hier"
report = {}
store = store_from_env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 120)
for label, algo in (("hier", HIER), ("default", "")):
    os.environ["PLAIT_ALGO"] = algo  # read by plait.init (the script, not plait, sets it)
    comm = plait.init(store=store)
    for count, dtype, lib in ((1, "int64", "numpy"), (7, "bfloat16", "torch"),
                              (30001, "float32", "numpy"), (262144, "int32", "torch")):
        case_ops(comm, OPS, count, dtype, lib)
    info = comm.describe()
    hubs = [("world", info)]
    if info["hier"] is not None:
        hubs += [("local", info["hier"]["local_group"].describe()),
                 ("rail", info["hier"]["rail_group"].describe())]
    report[label] = {
        "transports": [comm.peer_transport(r) for r in range(comm.size)],
        "hier": info["hier"] is not None,
        "listen": {k: d["listen"] for k, d in hubs if d.get("listen")},
        "sources": sorted({a for _, d in hubs for a in d.get("sources", [])}),
        "streams": max([d.get("streams", 0) for _, d in hubs] or [0]),
    }
    comm.close()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_every_collective_on_two_hosts_two_rails(tmp_path: Path) -> None:
    with Cluster(hosts=2, rails=2, rate=None, ecmp=False) as c:
        topo = tmp_path / "topo.json"
        topo.write_text(json.dumps(from_cluster_spec(c.spec())))
        env = {"PYTHONPATH": os.pathsep.join(p for p in (PLAIT_ROOT, os.environ.get(
            "PYTHONPATH", "")) if p), "TESTS_DIR": TESTS, "PLAIT_TOPO_FILE": str(topo),
            "PLAIT_TCP_CHUNK_SIZE": "64K", "PLAIT_NSOCKS": "3", "PLAIT_TIMEOUT": "60"}
        res = c.launch([sys.executable, "-c", RANK_SCRIPT], ranks_per_host=2, env=env,
                       timeout=150)
        res.check()
        reports = []
        for r in res.ranks:
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")][-1]
            reports.append(json.loads(line[len("REPORT "):]))
    for rank, rep in enumerate(reports):
        host, local = divmod(rank, 2)
        rail_addr = f"10.77.{local}.{host + 1}"
        for label in ("hier", "default"):
            got = rep[label]
            assert got["transports"] == ["shm" if p // 2 == host else "tcp" for p in range(4)]
            assert set(got["listen"].values()) == {rail_addr}, (rank, label, got)
            assert got["sources"] == [rail_addr], (rank, label, got)
            assert got["streams"] == 3
        assert rep["hier"]["hier"] and set(rep["hier"]["listen"]) == {"world", "rail"}
