"""Timeline of a shrink: SIGKILL -> typed error on every survivor -> shrunk communicator
ready -> first allreduce on it done.

    python benchmarks/shrink_timeline.py                      # shm and tcp, 4 ranks, 3 trials
    python benchmarks/shrink_timeline.py --size 5 --trials 5 --transport tcp

The parent hosts the TCPStore (it outlives every rank, as shrink needs) and starts the
ranks, which run 8-element allreduces in a loop; once every rank is in the loop the
parent SIGKILLs rank ``--victim`` (it stays an unreaped zombie until the trial ends, as
under a parent that does not reap). Every survivor notes (wall clock, one host) when it
got the error, when ``shrink()`` returned, and when its first allreduce on the new
communicator completed; the figures are the slowest survivor's, from the kill.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import socket
import statistics
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, size: int, port: int, transport: str, out: Any) -> None:
    import numpy as np
    import torch.distributed as dist

    import plait

    if transport == "tcp":
        os.environ["PLAIT_TRANSPORT"] = "tcp"
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    comm = plait.init(rank, size, store=dist.PrefixStore("timeline/", store), timeout=60)
    buf = np.ones(8, dtype=np.float32)
    store.set(f"looping/{rank}", "1")
    try:
        while True:
            comm.allreduce(buf)
    except plait.PeerFailedError as exc:
        t_error, peer = time.time(), exc.peer
    res = comm.shrink()
    t_ready = time.time()
    new = res.comm
    x = np.full(8, new.rank + 1, dtype=np.int64)
    new.allreduce(x)
    t_next = time.time()
    assert x.tolist() == [new.size * (new.size + 1) // 2] * 8, x
    out.put((rank, peer, t_error, t_ready, t_next, res.ranks))
    new.close()
    comm.close()


def trial(size: int, victim: int, transport: str) -> tuple[float, float, float]:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, transport, out))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        server.wait([f"looping/{r}" for r in range(size)], datetime.timedelta(seconds=120))
        time.sleep(0.2)
        t_kill = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        rows = [out.get(timeout=60) for _ in range(size - 1)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for _, peer, *_ in rows:
        assert peer == victim, rows
    return (max(r[2] for r in rows) - t_kill, max(r[3] for r in rows) - t_kill,
            max(r[4] for r in rows) - t_kill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--transport", choices=["shm", "tcp", "both"], default="both")
    args = parser.parse_args()
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    print(f"{args.size} ranks, rank {args.victim} SIGKILLed; seconds from the kill, "
          "slowest survivor; median (min-max) of "
          f"{args.trials} trials")
    print(f"{'transport':10s} {'error':>22s} {'shrunk comm ready':>22s} "
          f"{'first allreduce':>22s}")
    for transport in transports:
        runs = [trial(args.size, args.victim, transport) for _ in range(args.trials)]
        cols = []
        for i in range(3):
            xs = [r[i] for r in runs]
            cols.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        print(f"{transport:10s} {cols[0]:>22s} {cols[1]:>22s} {cols[2]:>22s}")


if __name__ == "__main__":
    main()
