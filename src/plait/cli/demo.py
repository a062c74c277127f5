"""``plait demo``: launch local ranks, run every collective on both transports, check the
results and print a timing table.

The parent process starts ``-n`` ranks per transport (shared memory, then TCP forced with
PLAIT_TRANSPORT=tcp); each rank runs every operation on exact data that depends on rank
and index, checks it against the expected result, and rank 0 reports median times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

OPS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
       "alltoall", "sendrecv", "barrier")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nranks", type=int, default=4, help="ranks to launch (4)")
    parser.add_argument("--sizes", default="8,65536,4194304",
                        help="message sizes in bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("--transports", default="shm,tcp", help="shm,tcp")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    failed = False
    for transport in args.transports.split(","):
        env = dict(os.environ)
        env["PLAIT_TRANSPORT"] = "tcp" if transport == "tcp" else "auto"
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(args.nranks))
        procs = []
        for r in range(args.nranks):
            e = dict(env, RANK=str(r))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "plait.cli.main", "demo", "--worker", "--sizes",
                 args.sizes, "--iters", str(args.iters)], env=e, stdout=subprocess.PIPE,
                text=True))
        outs = []
        deadline = time.monotonic() + 600
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                print(f"demo ({transport}): timed out", file=sys.stderr)
                return 1
            outs.append(out)
            if p.returncode != 0:
                failed = True
        if failed:
            print(f"demo ({transport}): a rank failed (see above)", file=sys.stderr)
            for q in procs:
                if q.poll() is None:
                    q.kill()
            return 1
        report = json.loads(outs[0].strip().splitlines()[-1])
        print(f"\n{transport}: {args.nranks} ranks, every result checked "
              f"({report['checked']} checks, 0 wrong); median time per call (us)")
        print(f"{'op':16}" + "".join(f"{_fmt_size(s):>12}" for s in sizes))
        for op in OPS:
            row = report["times"][op]
            print(f"{op:16}" + "".join(f"{row[str(s)]:12.1f}" for s in sizes))
    return 0


def _fmt_size(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def _data(count: int, rank: int, salt: int = 0) -> np.ndarray:
    """Exact float32 data: small integers, so sums are exact in any order."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 131 + salt * 17) % 61 - 30
            ).astype(np.float32)


def _worker(args: argparse.Namespace) -> int:
    import plait

    comm = plait.init()
    r, n = comm.rank, comm.size
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[str, dict[str, float]] = {op: {} for op in OPS}
    checked = 0
    for nbytes in sizes:
        c = max(1, nbytes // 4)
        everyone = [_data(c, k) for k in range(n)]
        total = np.sum(everyone, axis=0)
        for op in OPS:
            samples = []
            for _ in range(args.iters + 2):
                call, check = _case(comm, op, c, r, n, everyone, total)
                comm.barrier()
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
                if not check():
                    raise AssertionError(f"rank {r}: {op} of {nbytes} bytes gave a wrong result")
                checked += 1
            times[op][str(nbytes)] = float(np.median(samples[2:]) * 1e6)
    # every rank's median, reduced to the slowest rank's
    for op in OPS:
        vals = np.array([times[op][str(s)] for s in sizes], dtype=np.float64)
        comm.allreduce(vals, "max")
        times[op] = {str(s): float(v) for s, v in zip(sizes, vals, strict=True)}
    comm.close()
    if r == 0:
        print(json.dumps({"times": times, "checked": checked}))
    return 0


def _case(comm: Any, op: str, c: int, r: int, n: int, everyone: list[np.ndarray],
          total: np.ndarray) -> tuple[Any, Any]:
    root = n - 1
    if op == "allreduce":
        b = everyone[r].copy()
        return (lambda: comm.allreduce(b)), (lambda: np.array_equal(b, total))
    if op == "broadcast":
        b = everyone[r].copy()
        return (lambda: comm.broadcast(b, root)), (lambda: np.array_equal(b, everyone[root]))
    if op == "reduce":
        b = everyone[r].copy()
        want = total if r == root else everyone[r]
        return (lambda: comm.reduce(b, root)), (lambda: np.array_equal(b, want))
    if op == "allgather":
        out = np.empty(c * n, np.float32)
        return (lambda: comm.allgather(everyone[r], out)), \
            (lambda: np.array_equal(out, np.concatenate(everyone)))
    if op == "gather":
        out = np.empty(c * n, np.float32) if r == root else None
        return (lambda: comm.gather(everyone[r], out, root)), \
            (lambda: out is None or np.array_equal(out, np.concatenate(everyone)))
    if op == "scatter":
        src = np.concatenate(everyone) if r == root else None
        out = np.empty(c, np.float32)
        return (lambda: comm.scatter(src, out, root)), (lambda: np.array_equal(out, everyone[r]))
    if op == "reduce_scatter":
        blk = max(1, c // n)
        send = np.concatenate([everyone[r][:blk] + k for k in range(n)])
        out = np.empty(blk, np.float32)
        want = sum(everyone[k][:blk] for k in range(n)) + n * r
        return (lambda: comm.reduce_scatter(send, out)), (lambda: np.array_equal(out, want))
    if op == "alltoall":
        blk = max(1, c // n)
        send = np.concatenate([_data(blk, r, salt=k) for k in range(n)])
        out = np.empty(blk * n, np.float32)
        want = np.concatenate([_data(blk, k, salt=r) for k in range(n)])
        return (lambda: comm.alltoall(send, out)), (lambda: np.array_equal(out, want))
    if op == "sendrecv":
        # a ring shift: send to the right, receive from the left
        out = np.empty(c, np.float32)
        right, left = (r + 1) % n, (r - 1) % n

        def call() -> None:
            w = comm.irecv(out, left, tag=7)
            comm.send(everyone[r], right, tag=7)
            w.wait()

        return call, (lambda: np.array_equal(out, everyone[left]))
    assert op == "barrier"
    return (lambda: comm.barrier()), (lambda: True)
