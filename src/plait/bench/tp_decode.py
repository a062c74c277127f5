"""Tensor-parallel decode: per-token latency, tokens/s and time in collectives, checked.

One launch is one TP world of ``tp`` local processes (torch.multiprocessing, a free port,
a TCPStore). The default group is plait; a gloo group over the same ranks serves the gloo
rows. For each dtype and batch size, every *mode* (how the two allreduces of each layer
are made) decodes the same teacher-forced tokens with the same weights, modes
interleaved over repetitions:

- ``plait``: ``dist.all_reduce`` on the plait group;
- ``plait-op``: ``torch.ops.plait.all_reduce_`` on it;
- ``gloo``: ``dist.all_reduce`` on the gloo group;
- ``deepspeed``: DeepSpeed's CPU shm kernel (``deepspeed.comm.inference_all_reduce``),
  only where ``import deepspeed`` works; otherwise the row says why it was skipped;
- with ``compile``: ``plait-funcol`` (functional collectives, eager and compiled) and
  ``plait-op`` compiled with ``torch.compile`` (inductor), graph breaks counted by
  ``torch._dynamo.explain``.

Rank 0 also runs the single-process model (``tp = 1``, same weights) on the same tokens:
every mode's logits must match it within :data:`TOLERANCE` (norm-wise relative error of
each step's logits, the largest over steps and sequences), and compiled modes must match
their eager twins within the same tolerance.

Accuracy tolerances: float32 1e-5, bfloat16 2.5e-2. In float32, TP changes only the
order of the additions in the row-parallel matmuls (partial sums over ``hidden / tp``
columns, then the allreduce): differences of a few ulps that the network does not amplify
much (measured: 5-6e-7 at hidden 1024, 4 layers), far below 1e-5. In bfloat16 each
row-parallel output is *rounded to bfloat16 twice* under TP (each rank's partial sum, then
the allreduce's result) instead of once: extra roundings of relative size up to
u = 2**-8 = 3.9e-3, two per layer, of the same kind and size as the roundings bfloat16
already makes at every op. So the TP model's distance from the single-process bfloat16
model is of the order of bfloat16's own error: measured 1.1-1.3e-2, where the
single-process bfloat16 model differs from its float32 twin by 1.2e-2 (``bf16_vs_fp32``
in the results). The tolerance, about twice bfloat16's own error (6.4 u), accepts that
noise with headroom for other sizes, and rejects structural errors by a factor of 25: a
missing reduction gives 0.88, a reduction applied twice 0.66 (same config).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .decoder import Decoder, DecoderConfig, Reduce, no_reduce, rel_error, teacher_tokens
from .setup import free_port

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.5e-2}
EAGER_MODES = ("plait", "plait-op", "gloo", "deepspeed")
WARMUP_STEPS = 4


@dataclass
class RunOptions:
    cfg: DecoderConfig = field(default_factory=DecoderConfig)
    tp: int = 2
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    batches: tuple[int, ...] = (1, 8)
    steps: int = 64
    reps: int = 2
    threads: int = 0  # per rank; 0: cores // tp (at least 1)
    compile: bool = False
    modes: tuple[str, ...] = EAGER_MODES

    def rank_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.tp)


class CollTimer:
    """Wall time spent inside the reductions (eager modes only)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Reduce) -> Reduce:
        def timed(t: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = fn(t)
            self.seconds += time.perf_counter() - t0
            return out

        return timed


def _deepspeed_reduce() -> Reduce | str:
    """DeepSpeed's CPU shm allreduce, or why it is skipped. Not exercised where deepspeed
    does not import (it does not on the development machine)."""
    try:
        import deepspeed.comm as dscomm  # type: ignore[import-not-found]

        dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    except Exception as exc:  # ImportError, or a build/initialisation failure
        return f"skipped: deepspeed unavailable ({type(exc).__name__}: {exc})"

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dscomm.inference_all_reduce(t)
        return t

    return reduce


def make_reduce(mode: str, group: Any, gloo: Any) -> Reduce | str:
    """The reduction a mode uses, or a string saying why the mode is skipped."""
    if mode == "plait":
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=group)
            return t
    elif mode == "gloo":
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=gloo)
            return t
    elif mode == "plait-op":
        import plait.torch  # noqa: F401 - defines torch.ops.plait

        name = group.group_name

        def reduce(t: torch.Tensor) -> torch.Tensor:
            torch.ops.plait.all_reduce_(t, name, "sum")
            return t
    elif mode == "plait-funcol":
        import torch.distributed._functional_collectives as funcol

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))
    elif mode == "deepspeed":
        return _deepspeed_reduce()
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return reduce


@dataclass
class Decoded:
    logits: torch.Tensor  # [steps, batch, vocab] float32
    step_s: list[float]
    coll_s: list[float]  # per step, in the reductions (empty without a timer)


def decode(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: Decoder,
           tokens: torch.Tensor, timer: CollTimer | None = None) -> Decoded:
    """Teacher-forced decode of ``tokens`` [steps, batch] from an empty cache."""
    model.reset(tokens.shape[1])
    positions = [torch.tensor(i) for i in range(tokens.shape[0])]
    logits, times, coll = [], [], []
    with torch.no_grad():
        for i, pos in enumerate(positions):
            c0 = timer.seconds if timer is not None else 0.0
            t0 = time.perf_counter()
            out = step(tokens[i], pos)
            times.append(time.perf_counter() - t0)
            if timer is not None:
                coll.append(timer.seconds - c0)
            logits.append(out)
    return Decoded(torch.stack(logits), times, coll)


@dataclass
class Variant:
    """One way of running the TP model: a mode, eager or compiled. Eager variants share
    one model and put their reduction in before each decode."""

    mode: str
    compiled: bool
    model: Decoder
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    timer: CollTimer | None
    reduce: Reduce | None = None
    graph_breaks: int | None = None
    compile_s: float | None = None
    runs: list[Decoded] = field(default_factory=list)

    def run(self, tokens: torch.Tensor) -> Decoded:
        if self.reduce is not None:
            self.model.reduce = self.reduce
        return decode(self.step, self.model, tokens, self.timer)


def _build(opts: RunOptions, rank: int, dtype: torch.dtype, group: Any, gloo: Any,
           skipped: dict[str, str]) -> list[Variant]:
    variants: list[Variant] = []
    shared: Decoder | None = None
    for mode in list(opts.modes) + (["plait-funcol"] if opts.compile else []):
        reduce = make_reduce(mode, group, gloo)
        if isinstance(reduce, str):
            skipped[mode] = reduce
            continue
        if shared is None:
            shared = Decoder(opts.cfg, rank=rank, tp=opts.tp, dtype=dtype)
        timer = CollTimer()
        variants.append(Variant(mode, False, shared, shared, timer, timer.wrap(reduce)))
    if opts.compile:
        for mode in ("plait-funcol", "plait-op"):
            reduce = make_reduce(mode, group, gloo)
            assert not isinstance(reduce, str)
            model = Decoder(opts.cfg, rank=rank, tp=opts.tp, dtype=dtype, reduce=reduce)
            variants.append(Variant(mode, True, model, torch.compile(model), None))
    return variants


def _graph_breaks_seen() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _explain(v: Variant, tokens: torch.Tensor) -> None:
    """``torch._dynamo.explain``'s graph-break count (explain resets dynamo: run it for
    every variant before compiling any)."""
    v.model.reset(tokens.shape[1])
    with torch.no_grad():
        explanation = torch._dynamo.explain(v.model)(tokens[0], torch.tensor(0))
    v.graph_breaks = int(explanation.graph_break_count)


def _compile(v: Variant, tokens: torch.Tensor) -> None:
    """Compile (the first call), timed; graph breaks the real compile adds are counted
    too (a backend that fails on a graph falls back by breaking it)."""
    v.model.reset(tokens.shape[1])
    with torch.no_grad():
        before = _graph_breaks_seen()
        t0 = time.perf_counter()
        v.step(tokens[0], torch.tensor(0))
        v.compile_s = time.perf_counter() - t0
    v.graph_breaks = (v.graph_breaks or 0) + _graph_breaks_seen() - before


def _references(opts: RunOptions, dtype: torch.dtype) -> tuple[Decoder, Decoder | None]:
    """The single-process model (and, for bf16, its float32 twin)."""
    ref = Decoder(opts.cfg, dtype=dtype, reduce=no_reduce)
    twin = None if dtype == torch.float32 else Decoder(opts.cfg, reduce=no_reduce)
    return ref, twin


def _reference_row(models: tuple[Decoder, Decoder | None], dname: str, tokens: torch.Tensor
                   ) -> tuple[Decoded, dict[str, Any]]:
    ref, twin = models
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the other ranks wait in a barrier
    try:
        decode(ref, ref, tokens[:WARMUP_STEPS])
        out = decode(ref, ref, tokens)
        twin_err = None if twin is None else rel_error(out.logits,
                                                       decode(twin, twin, tokens).logits)
    finally:
        torch.set_num_threads(threads)
    return out, {"dtype": dname, "batch": int(tokens.shape[1]), "latency_ms": _median_ms([out]),
                 "threads": os.cpu_count() or 1, "bf16_vs_fp32": twin_err}


def _median_ms(runs: list[Decoded]) -> float:
    return 1e3 * statistics.median(statistics.median(r.step_s) for r in runs)


def _row(v: Variant, dtype: str, batch: int, ref: Decoded, eager: Decoded | None,
         coll_medians: list[float]) -> dict[str, Any]:
    step_total = sum(sum(r.step_s) for r in v.runs)
    tokens = sum(len(r.step_s) for r in v.runs)
    mean_s = step_total / tokens
    row: dict[str, Any] = {
        "dtype": dtype, "batch": batch, "mode": v.mode, "compiled": v.compiled,
        "latency_ms": _median_ms(v.runs), "latency_mean_ms": 1e3 * mean_s,
        "tokens_per_s": 1e3 * batch / _median_ms(v.runs), "tokens_per_s_mean": batch / mean_s,
        "rel_err": max(rel_error(r.logits, ref.logits) for r in v.runs),
        "tolerance": TOLERANCE[dtype],
    }
    if v.timer is not None:
        # each rank's median per step, averaged over ranks; share of the median step
        coll = statistics.mean(coll_medians)
        row["coll_ms_per_token"] = 1e3 * coll
        row["coll_share"] = coll / statistics.median(t for r in v.runs for t in r.step_s)
    if v.compiled:
        row["graph_breaks"] = v.graph_breaks
        row["compile_s"] = v.compile_s
        assert eager is not None
        row["rel_err_vs_eager"] = max(rel_error(r.logits, eager.logits) for r in v.runs)
    return row


def _die_with_parent() -> None:
    """Linux: end this rank when the launching process dies (killed, interrupted), so no
    rank outlives the benchmark."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def rank_main(rank: int, opts: RunOptions, port: int, out_path: str) -> None:
    """One rank of the TP world; rank 0 writes the results to ``out_path`` (JSON)."""
    _die_with_parent()
    torch.set_num_threads(opts.rank_threads())
    if opts.compile:
        import torch._inductor.config as inductor_config

        # no pool of compile workers: on a few cores they would run beside the timed steps
        inductor_config.compile_threads = 1
    store = dist.TCPStore("127.0.0.1", port, world_size=opts.tp, is_master=rank == 0)
    import plait.torch  # noqa: F401 - registers the backend

    dist.init_process_group("plait", store=store, rank=rank, world_size=opts.tp)
    try:
        _run(rank, opts, out_path)
    finally:
        dist.destroy_process_group()


def _run(rank: int, opts: RunOptions, out_path: str) -> None:
    group = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    rows: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for dname in opts.dtypes:
        dtype = DTYPES[dname]
        variants = _build(opts, rank, dtype, group, gloo, skipped)
        references = _references(opts, dtype) if rank == 0 else None
        for batch in opts.batches:
            tokens = teacher_tokens(opts.cfg, batch, opts.steps)
            ref: Decoded | None = None
            if references is not None:
                ref, ref_row = _reference_row(references, dname, tokens)
                refs.append(ref_row)
            dist.barrier(group=gloo)
            for v in variants:
                v.runs = []
                if v.compiled:
                    _explain(v, tokens)
            for v in variants:
                if v.compiled:
                    _compile(v, tokens)
                v.run(tokens[:WARMUP_STEPS])
            for rep in range(opts.reps):
                # each repetition in another order: no mode always follows the same one
                k = rep % len(variants)
                for v in (variants[k:] + variants[:k])[::(-1) ** rep]:
                    dist.barrier(group=gloo)
                    v.runs.append(v.run(tokens))
            eager = {v.mode: v for v in variants if not v.compiled}
            for v in variants:
                all_coll: list[Any] = [None] * opts.tp
                mine = [c for r in v.runs for c in r.coll_s]
                dist.all_gather_object(all_coll, statistics.median(mine) if mine else 0.0,
                                       group=gloo)
                if ref is not None:
                    twin_run = eager[v.mode].runs[0] if v.compiled else None
                    rows.append(_row(v, dname, batch, ref, twin_run, all_coll))
    if rank == 0:
        result = {"config": asdict(opts.cfg), "tp": opts.tp, "steps": opts.steps,
                  "reps": opts.reps, "threads_per_rank": opts.rank_threads(),
                  "cores": os.cpu_count(), "torch": torch.__version__,
                  "oversubscribed": opts.tp * opts.rank_threads() > (os.cpu_count() or 1),
                  "rows": rows, "reference": refs, "skipped": skipped}
        Path(out_path).write_text(json.dumps(result, indent=1))


def launch(opts: RunOptions, out_path: str) -> dict[str, Any]:
    """Run one TP world of ``opts.tp`` local processes; rank 0's results."""
    import torch.multiprocessing as mp

    mp.start_processes(rank_main, args=(opts, free_port(), out_path), nprocs=opts.tp,
                       start_method="spawn", join=True)
    return json.loads(Path(out_path).read_text())  # type: ignore[no-any-return]


def failures(result: dict[str, Any]) -> list[str]:
    """Accuracy and graph-break failures of one launch (empty when every check passed)."""
    bad: list[str] = []
    for r in result["rows"]:
        what = f"tp={result['tp']} {r['dtype']} batch {r['batch']} {r['mode']}" + (
            " compiled" if r["compiled"] else "")
        if not r["rel_err"] <= r["tolerance"]:
            bad.append(f"{what}: logits differ from the single-process model by "
                       f"{r['rel_err']:.3g} > {r['tolerance']:.3g}")
        if r["compiled"]:
            if r["graph_breaks"] != 0:
                bad.append(f"{what}: {r['graph_breaks']} graph breaks")
            if not r["rel_err_vs_eager"] <= r["tolerance"]:
                bad.append(f"{what}: logits differ from eager by {r['rel_err_vs_eager']:.3g}")
    return bad
