"""The timing loop: one per rank, the same for every operation and backend.

For each operation and size every backend runs, in each mode: ``check`` verified calls
on exact data, ``warmup`` calls, then ``reps`` timed batches of ``iters`` calls, each
batch after that backend's own barrier. Batches of the backends (and of the two modes)
are interleaved, in alternating order, so a noisy machine hurts every side alike; a row
reports the median over repetitions of the batch's time per call averaged over ranks
(nccl-tests' default). Only rank 0 prints and writes files; a control group (gloo) that
is never measured carries timings, error counts and barriers between the phases.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from . import report
from .backends import DECISIONS, Backend, Step
from .collectives import MODES, collective, storage_dtype
from .options import BenchOptions
from .results import Measurement, Row
from .setup import Control, make_backends


def timed(step: Step, iters: int) -> float:
    """Seconds per call over ``iters`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(nbytes: int = 64 << 20, reps: int = 9) -> list[float]:
    """Single-thread copy bandwidth samples in GB/s: ``np.copyto`` of ``nbytes`` (read+write
    of the buffer counted once, as a memcpy benchmark reports it)."""
    src = np.arange(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    dst.fill(0)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def run_rows(opts: BenchOptions, rank: int, size: int, backends: list[Backend], ctl: Control,
             on_row: Callable[[Row], None], progress: report.Progress | None) -> list[Row]:
    """Measure every (operation, size) on every backend; returns rank-averaged rows."""
    rows = []
    itemsize = storage_dtype(opts.dtype).itemsize
    root = opts.root % size
    for op in opts.ops:
        coll = collective(op)
        for nbytes in opts.sizes():
            if progress is not None:
                progress.update(f"{op} {report.human_size(nbytes)}")
            lay = coll.layout(nbytes, itemsize, size)
            if lay is None:
                if progress is not None:
                    progress.advance()
                continue  # fewer elements than ranks
            cases = coll.cases(lay, rank, size, root, opts.dtype, opts.redop)
            modes = [m for m in MODES if m in cases]
            results = {b.label: {m: Measurement() for m in modes} for b in backends}
            steps: dict[tuple[str, str], Step] = {}
            for b in backends:
                for m in modes:
                    why = b.why_not(op, m, opts.dtype, opts.redop)
                    if why is not None:
                        results[b.label][m].skipped = why
                        continue
                    case = cases[m]
                    step = b.step(op, m, case, root, opts.redop, opts.dtype)
                    steps[b.label, m] = step
                    for _ in range(opts.check):
                        case.fill()
                        b.barrier()
                        step()
                        results[b.label][m].wrong += case.check()
            # backends share the buffers: re-fill them only once every check is done
            for case in cases.values():
                case.steady()
            for step in steps.values():
                for _ in range(opts.warmup):
                    step()
            local: list[float] = []
            keys = list(steps)
            for rep in range(opts.reps):
                # alternate the order so neither backend always runs first after a switch
                for key in keys if rep % 2 == 0 else reversed(keys):
                    backend = next(b for b in backends if b.label == key[0])
                    backend.barrier()
                    local.append(timed(steps[key], opts.iters))
            wrong_local = [results[k[0]][k[1]].wrong for k in keys]
            total = ctl.sum(np.array(local + wrong_local, dtype=np.float64))
            per_rep = (total[:len(local)] / size * 1e6).reshape(opts.reps, len(keys))
            for i, key in enumerate(keys):
                rep_order = [per_rep[r, i if r % 2 == 0 else len(keys) - 1 - i]
                             for r in range(opts.reps)]
                res = results[key[0]][key[1]]
                res.samples_us = [float(v) for v in rep_order]
                res.wrong = int(total[len(local) + i])
            row = Row(op, lay.size, lay.count, opts.dtype,
                      opts.redop if coll.reduces else None, root if coll.rooted else None,
                      coll.bus_factor(size), results,
                      backends[0].algorithm(op))
            rows.append(row)
            if rank == 0:
                on_row(row)
            if progress is not None:
                progress.advance()
    return rows


def worker(opts: BenchOptions, rank: int, size: int, launcher: str) -> int:
    """One rank of the benchmark: set up backends, measure, report on rank 0."""
    DECISIONS.install()
    backends, ctl, skipped = make_backends(opts, rank, size)
    progress = report.Progress(sys.stderr, total=len(opts.ops) * len(opts.sizes())) \
        if rank == 0 and opts.progress else None
    printer = report.TablePrinter(opts, size, [b.label for b in backends], sys.stdout,
                                  progress)
    copy_samples: list[float] = []
    try:
        ctl.barrier()
        if rank == 0:
            printer.header(launcher, skipped)
            copy_samples += copy_bandwidth()  # the other ranks wait, idle, in the barrier
        ctl.barrier()
        rows = run_rows(opts, rank, size, backends, ctl, printer.row, progress)
        ctl.barrier()
        if rank == 0:
            copy_samples += copy_bandwidth()
        ctl.barrier()
    finally:
        if progress is not None:
            progress.close()
    wrong = sum(m.wrong for r in rows for ms in r.results.values() for m in ms.values())
    if rank == 0:
        copy_gbps = statistics.median(copy_samples)
        printer.footer(rows, copy_gbps, wrong)
        env = report.environment(opts, size, launcher, backends, skipped, copy_samples)
        if opts.json:
            report.write_json(opts.json, opts, env, rows, copy_gbps)
        if opts.plot:
            report.plot(opts.plot, rows, [b.label for b in backends], size)
        sys.stdout.flush()
    ctl.barrier()
    for b in backends:
        b.close()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 1 if wrong else 0
