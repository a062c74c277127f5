"""DDP step time of examples/ddp_train.py on plait against gloo (issue target: <= 0.8 x).

    python benchmarks/ddp_vs_gloo.py [--runs 5] [--nproc 2] [--steps 40]

Runs the example under torchrun, alternating backends run by run so that noise hits both
alike, and prints each backend's median over runs of the per-run median step time.
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(backend: str, nproc: int, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(EXAMPLE),
           "--backend", backend, "--steps", str(steps), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{out.stdout}\n{out.stderr}")
    m = re.search(r"median step ([0-9.]+) ms", out.stdout)
    if m is None:
        raise SystemExit(f"no step time in the output of {backend}:\n{out.stdout}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("extra", nargs="*", help="more arguments for the example")
    a = p.parse_args()
    times: dict[str, list[float]] = {"plait": [], "gloo": []}
    for i in range(a.runs):
        order = ("plait", "gloo") if i % 2 == 0 else ("gloo", "plait")
        for b in order:
            times[b].append(one(b, a.nproc, a.steps, a.extra))
    med = {b: statistics.median(v) for b, v in times.items()}
    for b, v in times.items():
        print(f"{b:6} median step {med[b]:8.2f} ms  (runs: {', '.join(f'{x:.2f}' for x in v)})")
    print(f"plait / gloo = {med['plait'] / med['gloo']:.2f} (target <= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
