"""Instructions per 8-byte allreduce on plait's API, counted by callgrind (deterministic,
unlike time on this machine): the refactoring check of issue 9.

    python benchmarks/callgrind_allreduce.py            # prints instructions per call

Two ranks on shared memory. Rank 1 runs natively and answers at once; rank 0 runs under
``valgrind --tool=callgrind`` twice, with 1000 and with 1000 + N allreduces, and the
difference divided by N is the cost of one call (start-up and teardown cancel out). Rank 0 under
valgrind is ~50x slower than rank 1, so it almost never waits: the count is the path
itself, not spinning. No torch: ranks meet through a small file-based store.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class FileStore:
    """The four Store methods plait uses, over files in one directory (atomic renames)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key.replace("/", "%")

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.rename(self._path(key))

    def get(self, key: str) -> bytes:
        while not self._path(key).exists():
            time.sleep(0.001)
        return self._path(key).read_bytes()

    def check(self, keys: list[str]) -> bool:
        return all(self._path(k).exists() for k in keys)

    def add(self, key: str, amount: int) -> int:
        # one counter per rank's first call is all plait.init needs here: use a lock file
        lock = self._path(key).with_suffix(".lock")
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL)
                break
            except FileExistsError:
                time.sleep(0.001)
        try:
            p = self._path(key)
            value = int(p.read_text()) + amount if p.exists() else amount
            p.write_text(str(value))
            return value
        finally:
            os.close(fd)
            os.unlink(lock)


def worker(rank: int, root: str, calls: int) -> None:
    import plait

    comm = plait.init(rank, 2, store=FileStore(root), timeout=600)
    x = np.arange(2, dtype=np.float32) + rank
    comm.allreduce(x)  # warm the caches (reducer, selection, channels)
    if rank == 1:
        comm.barrier()  # rank 0 tells us how many calls follow: as many as it makes
        n = int(FileStore(root).get("calls"))
        for _ in range(n):
            comm.allreduce(x)
    else:
        FileStore(root).set("calls", str(calls))
        comm.barrier()
        for _ in range(calls):
            comm.allreduce(x)
    comm.close()


def count(calls: int) -> int:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        me = [sys.executable, __file__, "--worker"]
        peer = subprocess.Popen([*me, "1", root, str(calls)], env=env)
        try:
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg",
                            *me, "0", root, str(calls)], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finally:
            peer.wait(timeout=120)
        text = subprocess.run(["callgrind_annotate", f"{out}/cg"], capture_output=True,
                              text=True, check=True).stdout
    m = re.search(r"([\d,]+)\s+\(100.0%\)\s+PROGRAM TOTALS", text) or re.search(
        r"([\d,]+)\s+PROGRAM TOTALS", text)
    if m is None:
        raise RuntimeError("callgrind_annotate printed no program total")
    return int(m.group(1).replace(",", ""))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--calls", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    # start-up waits (store polls, the segment's attach loop) vary by some 10^7
    # instructions between runs: many calls make that a small share of the figure
    for _ in range(args.repeat):
        base = count(1000)
        full = count(1000 + args.calls)
        print(f"instructions per 8 B allreduce (2 ranks, shm, rank 0): "
              f"{(full - base) / args.calls:,.0f}  ({full:,} - {base:,} over {args.calls} "
              "calls)", flush=True)


if __name__ == "__main__":
    main()
