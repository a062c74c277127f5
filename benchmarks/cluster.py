"""Topology-aware collectives on an emulated cluster (issue 5's targets), as root:

    python benchmarks/cluster.py [--reps 5] [--json out.json] [--only coll|ecmp]

1. ``coll``: 2 hosts x 2 ranks, 2 rails of 200 Mbit/s (tbf), local rank i bound to rail i
   through a topology file made from ``Cluster.spec()``. In one launch, interleaved per
   repetition: allreduce 16 MiB (float32) with plait's automatic choice, plait forced to a
   flat ring (``PLAIT_ALGO=allreduce:ring``) and gloo (``GLOO_SOCKET_IFNAME=rail0,rail1``);
   alltoall 16 MiB, plait automatic vs gloo ``all_to_all_single``.
2. ``ecmp``: 2 hosts x 1 rank, rails of 200 and 100 Mbit/s, ECMP between the hosts'
   addresses (the topology file gives each host one "rail": its host address on lo): one
   64 MiB send/recv for PLAIT_NSOCKS = 1, 2, 4, 8 (a fresh communicator, so fresh source
   ports and ECMP hashes, per repetition), against the combined 300 Mbit/s; and one
   300 Mbit/s rail as the reference of what a single shaped path delivers.

Prints medians (and every sample) with the cost model's prediction next to each, and
writes them as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
SIZE = 16 * MiB
P2P_SIZE = 64 * MiB

# -------------------------------------------------------------------------- rank side


def _timed(fn: Any, barrier: Any) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def rank_coll(reps: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import plait
    from plait.rendezvous import store_from_env
    from plait.tuning import selector

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = store_from_env(rank, n, 300)  # one store for every communicator here
    os.environ["PLAIT_ALGO"] = ""
    auto = plait.init(store=store)
    os.environ["PLAIT_ALGO"] = "allreduce:ring;alltoall:pairwise"
    flat = plait.init(store=store)
    dist.init_process_group("gloo", rank=rank, world_size=n,
                            store=dist.PrefixStore("gloo", store))
    count = SIZE // 4
    a = np.full(count, 1.0, dtype=np.float32)
    s = np.arange(count, dtype=np.float32)
    r = np.empty(count, dtype=np.float32)
    ta = torch.ones(count, dtype=torch.float32)
    ts, tr = torch.arange(count, dtype=torch.float32), torch.empty(count, dtype=torch.float32)
    cases = {
        "allreduce plait auto": (lambda: auto.allreduce(a), auto.barrier),
        "allreduce plait ring": (lambda: flat.allreduce(a), flat.barrier),
        "allreduce gloo": (lambda: dist.all_reduce(ta), dist.barrier),
        "alltoall plait auto": (lambda: auto.alltoall(s, r), auto.barrier),
        "alltoall plait pairwise": (lambda: flat.alltoall(s, r), flat.barrier),
        "alltoall gloo": (lambda: dist.all_to_all_single(tr, ts), dist.barrier),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for fn, bar in cases.values():  # warm-up: connections, sub-communicators
        _timed(fn, bar)
    for _ in range(reps):
        for k, (fn, bar) in cases.items():
            samples[k].append(_timed(fn, bar))
    sit = auto._situation
    model = {
        "allreduce plait auto": selector.choose("allreduce", SIZE, sit).describe(),
        "alltoall plait auto": selector.choose("alltoall", SIZE, sit).describe(),
        "allreduce ring": selector.estimate("allreduce", "ring", SIZE, sit),
        "allreduce hier": selector.estimate("allreduce", "hier", SIZE, sit),
        "alltoall pairwise": selector.estimate("alltoall", "pairwise", SIZE, sit),
        "alltoall hier": selector.estimate("alltoall", "hier", SIZE, sit),
    }
    if rank == 0:
        print("RESULT " + json.dumps({"samples": samples, "model": model, "ranks": n}))
    dist.destroy_process_group()
    flat.close()
    auto.close()


def rank_p2p(reps: int, nsocks_list: list[int]) -> None:
    import numpy as np

    import plait
    from plait.rendezvous import store_from_env

    rank = int(os.environ["RANK"])
    store = store_from_env(rank, int(os.environ["WORLD_SIZE"]), 300)
    buf = np.zeros(P2P_SIZE, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        for k in nsocks_list:
            os.environ["PLAIT_NSOCKS"] = str(k)
            comm = plait.init(store=store)
            comm.barrier()
            if rank == 0:  # connect first, so that the timing is the transfer only
                comm.send(ack, 1, tag=1)
                comm.recv(ack, 1, tag=2)
                t0 = time.perf_counter()
                comm.send(buf, 1)
                comm.recv(ack, 1, tag=2)
                samples.setdefault(f"nsocks={k}", []).append(time.perf_counter() - t0)
            else:
                comm.recv(ack, 0, tag=1)
                comm.send(ack, 0, tag=2)
                comm.recv(buf, 0)
                comm.send(ack, 0, tag=2)
            comm.close()
    if rank == 0:
        print("RESULT " + json.dumps({"samples": samples}))


# ------------------------------------------------------------------------ driver side


def _launch(cluster: Any, ranks_per_host: int, args: list[str], topo: dict[str, Any],
            env: dict[str, str], timeout: float) -> dict[str, Any]:
    import plait

    root = str(Path(plait.__file__).resolve().parent.parent)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(topo, f)
    full = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", ""))
                                         if p), "PLAIT_TOPO_FILE": f.name, **env}
    try:
        res = cluster.launch([sys.executable, __file__, *args], ranks_per_host=ranks_per_host,
                             env=full, timeout=timeout)
        res.check()
    finally:
        os.unlink(f.name)
    line = [ln for ln in res.ranks[0].stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return dict(json.loads(line[len("RESULT "):]))


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def run_coll(reps: int) -> dict[str, Any]:
    from plait.testbed import Cluster
    from plait.topology.file import from_cluster_spec

    with Cluster(hosts=2, rails=2, rate="200mbit", ecmp=False) as c:
        topo = from_cluster_spec(c.spec())
        out = _launch(c, 2, ["rank", "coll", str(reps)], topo, {}, 60 + reps * 40)
    n = out["ranks"]
    rows = {}
    for k, xs in out["samples"].items():
        t = _med(xs)
        factor = 2 * (n - 1) / n if k.startswith("allreduce") else (n - 1) / n
        rows[k] = {"median_s": t, "busbw_MBps": SIZE / t * factor / 1e6, "samples_s": xs}
    out["rows"] = rows
    return out


def run_ecmp(reps: int) -> dict[str, Any]:
    from plait.testbed import Cluster
    from plait.topology.file import from_cluster_spec

    with Cluster(hosts=2, rails=2, rate="200mbit,100mbit", ecmp=True) as c:
        topo = from_cluster_spec(c.spec(), host_address=True)
        ecmp = _launch(c, 1, ["rank", "p2p", str(reps), "1,2,4,8"], topo, {},
                       60 + reps * 4 * 30)
    with Cluster(hosts=2, rails=1, rate="300mbit", ecmp=False) as c:
        topo = from_cluster_spec(c.spec())
        ref = _launch(c, 1, ["rank", "p2p", str(reps), "1"], topo, {}, 60 + reps * 30)
    rows = {}
    for k, xs in ecmp["samples"].items():
        t = _med(xs)
        rows[f"ecmp 200+100 {k}"] = {"median_s": t, "Mbit_s": P2P_SIZE * 8 / t / 1e6,
                                     "of_300": P2P_SIZE * 8 / t / 300e6, "samples_s": xs}
    t = _med(ref["samples"]["nsocks=1"])
    rows["one 300mbit rail nsocks=1"] = {"median_s": t, "Mbit_s": P2P_SIZE * 8 / t / 1e6,
                                         "of_300": P2P_SIZE * 8 / t / 300e6,
                                         "samples_s": ref["samples"]["nsocks=1"]}
    model = P2P_SIZE * 8 / 300e6
    return {"rows": rows, "model_s": model}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        if argv[1] == "coll":
            rank_coll(int(argv[2]))
        else:
            rank_p2p(int(argv[2]), [int(x) for x in argv[3].split(",")])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=("coll", "ecmp"), default=None)
    a = p.parse_args(argv)
    result: dict[str, Any] = {}
    if a.only in (None, "coll"):
        coll = run_coll(a.reps)
        result["coll"] = coll
        rows, model = coll["rows"], coll["model"]
        print(f"2 hosts x 2 ranks, 2 rails x 200 Mbit/s, 16 MiB, medians of {a.reps}")
        for k, r in rows.items():
            print(f"  {k:28s} {r['median_s']:7.3f} s  busbw {r['busbw_MBps']:6.1f} MB/s")
        g, au, ri = (rows[f"allreduce {x}"]["median_s"] for x in ("gloo", "plait auto",
                                                                  "plait ring"))
        print(f"  allreduce: auto/gloo busbw {g / au:.2f}x, auto/ring {ri / au:.2f}x; "
              f"model: {model['allreduce plait auto']}")
        ga, aa = rows["alltoall gloo"]["median_s"], rows["alltoall plait auto"]["median_s"]
        print(f"  alltoall: auto/gloo {ga / aa:.2f}x; model: {model['alltoall plait auto']}")
    if a.only in (None, "ecmp"):
        ecmp = run_ecmp(a.reps)
        result["ecmp"] = ecmp
        print(f"64 MiB send/recv, ECMP over 200 + 100 Mbit/s (model at 300 Mbit/s: "
              f"{ecmp['model_s']:.2f} s), medians of {a.reps}")
        for k, r in ecmp["rows"].items():
            print(f"  {k:28s} {r['median_s']:7.3f} s  {r['Mbit_s']:6.1f} Mbit/s  "
                  f"{100 * r['of_300']:5.1f} % of 300  samples "
                  + " ".join(f"{x:.2f}" for x in r["samples_s"]))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
