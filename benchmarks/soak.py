"""Soak: N mixed collectives (random sizes, roots, dtypes, reduce ops), each verified, on
real rank processes; prints time and each rank's resident memory over the run.

    python benchmarks/soak.py [--ranks 4] [--ops 10000] [--transport shm|tcp|mixed]
"""

from __future__ import annotations

import argparse
import json

from plait.testing.harness import Pool
from plait.testing.soak import case_soak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--transport", default="shm", choices=["shm", "tcp", "mixed"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print the raw per-rank results")
    args = p.parse_args()
    with Pool(args.ranks, args.transport) as pool:
        results = pool.run(case_soak, args.ops, args.seed, deadline=3600)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.ops} verified collectives on {args.ranks} ranks ({args.transport}): "
          f"{results[0]['seconds']:.1f} s; kinds {results[0]['kinds']}")
    for r, res in enumerate(results):
        samples = ", ".join(f"{i}:{b / 2**20:.1f}" for i, b in res["rss"])
        print(f"  rank {r} resident MiB after op: {samples}")


if __name__ == "__main__":
    main()
