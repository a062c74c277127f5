"""The core issue's speed check: 2 ranks, plait vs torch's gloo, allreduce of 8 B and 64 MiB.

    python benchmarks/allreduce_vs_gloo.py               # plait's own API
    python benchmarks/allreduce_vs_gloo.py --api torch   # torch.distributed on plait
    python benchmarks/allreduce_vs_gloo.py --mpi         # Open MPI too (pip install 'plait[mpi]')

It runs ``plait bench`` (same processes, backends interleaved, medians of repetitions,
exact data checked) and prints the ratios the issues set targets for: plait's time at 8 B
over gloo's (target <= 0.1) and plait's bus bandwidth at 64 MiB over gloo's (target >= 1.7
for the core, >= 2 through torch.distributed), and the same against MPI when asked.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.bench.cli import main as bench_main

SMALL, LARGE = 8, 64 << 20


def _mode(row: dict[str, Any]) -> dict[str, Any]:
    # plait's and torch's allreduce are in place by API: compare in-place times
    return row["in_place"] if row["in_place"] and "time_us" in row["in_place"] \
        else row["out_of_place"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("plait", "torch"), default="plait")
    p.add_argument("--mpi", action="store_true", help="also compare with Open MPI (mpi4py)")
    p.add_argument("--reps", type=int, default=9, help="repetitions (default 9)")
    p.add_argument("-i", "--iters", type=int, default=20, help="iterations per repetition")
    p.add_argument("-n", "--nranks", type=int, default=2)
    a = p.parse_args()
    compare = "gloo,mpi" if a.mpi else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        rc = bench_main(["-n", str(a.nranks), "--ops", "allreduce", "-b", str(SMALL),
                         "-e", str(LARGE), "-f", str(LARGE // SMALL), "-w", "5",
                         "-i", str(a.iters), "--reps", str(a.reps), "--api", a.api,
                         "--compare", compare, "--json", str(out)])
        if rc != 0 or not out.exists():
            print(f"plait bench failed (exit {rc})", file=sys.stderr)
            return rc or 1
        data = json.loads(out.read_text())
    rows = {(r["size"], r["backend"]): _mode(r) for r in data["rows"]}
    me = data["environment"]["backends"][0]
    print()
    print(f"plait ({me}) against {', '.join(data['environment']['backends'][1:])}, "
          f"{data['environment']['ranks']} ranks, medians of {a.reps} repetitions "
          f"x {a.iters} iterations, in-place")
    for other in data["environment"]["backends"][1:]:
        small, large = rows[SMALL, me], rows[LARGE, me]
        o_small, o_large = rows[SMALL, other], rows[LARGE, other]
        if "time_us" not in small or "time_us" not in o_small:
            print(f"  {other}: not measured ({o_small.get('skipped')})")
            continue
        t_ratio = small["time_us"] / o_small["time_us"]
        bw_ratio = large["busbw_gbps"] / o_large["busbw_gbps"]
        print(f"  8 B    : {me} {small['time_us']:9.1f} us   {other} {o_small['time_us']:9.1f} us"
              f"   time ratio {t_ratio:6.3f}  ({1 / t_ratio:.1f}x faster)")
        print(f"  64 MiB : {me} {large['busbw_gbps']:9.2f} GB/s {other} "
              f"{o_large['busbw_gbps']:9.2f} GB/s busbw ratio {bw_ratio:6.2f}")
    best = data["summary"]["allreduce_max"]
    print(f"  single-thread copy bandwidth {data['copy_bandwidth_gbps']:.2f} GB/s; plait's "
          f"64 MiB allreduce reaches {100 * best['fraction_of_copy']:.0f} % of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
