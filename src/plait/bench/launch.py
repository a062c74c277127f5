"""Starting the ranks: under a launcher each process is a rank; otherwise ``plait bench``
starts ``-n`` local ranks itself — as plain processes, or under ``mpirun`` when MPI is
compared (MPI's ranks must be started by MPI). Fail fast: when one rank fails, the others
are stopped and its exit status is returned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

from .backends import mpi_missing, mpirun_path
from .options import BenchOptions
from .setup import free_port

WORKER = "plait.bench._worker"


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    # the children must import the same plait as this process (also from a source tree)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every rank; on the first failure stop the rest and return its status."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn_local(opts: BenchOptions) -> int:
    """Start ``opts.nranks`` ranks on this host, torchrun-style variables."""
    n = opts.nranks
    base = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    procs = []
    for rank in range(n):
        env = _child_env({**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        procs.append(subprocess.Popen([sys.executable, "-m", WORKER, opts.to_json()], env=env))
    return _wait_all(procs)


def spawn_mpirun(opts: BenchOptions) -> int:
    """Start the ranks under Open MPI's mpirun, so MPI can be measured next to plait."""
    env = _child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    mpirun = mpirun_path()
    if mpirun is None:
        raise RuntimeError("no mpirun found")  # launch() checks mpi_missing() first
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-n", str(opts.nranks),
           "-x", "PYTHONPATH", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
           sys.executable, "-m", WORKER, opts.to_json()]
    return _wait_all([subprocess.Popen(cmd, env=env)])


def launch(opts: BenchOptions) -> int:
    """Start the ranks on this host (under mpirun when MPI is compared and installed)."""
    if "mpi" in opts.compare:
        why = mpi_missing()
        if why is None:
            return spawn_mpirun(replace(opts, launcher="plait bench via mpirun"))
        # a comparison that was asked for and cannot run is an error, not a blank column
        print(f"plait bench: cannot compare with MPI: {why}", file=sys.stderr)
        return 2
    return spawn_local(replace(opts, launcher="plait bench"))
