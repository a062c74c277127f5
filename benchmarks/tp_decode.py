"""Tensor-parallel decode of a Llama-style decoder: plait vs gloo (vs DeepSpeed's shm op).

    python benchmarks/tp_decode.py                      # tp 2 and 4, bf16 + fp32, batch 1 + 8
    python benchmarks/tp_decode.py --compile            # + torch.compile (funcol, plait op)
    python benchmarks/tp_decode.py --tp 2 --hidden 2048 --dtypes bfloat16 --batches 1
    python benchmarks/tp_decode.py --json docs/perf/tp_decode.json --plot docs/perf/tp_decode.png

For each TP size it starts one world of local processes (torch.multiprocessing, free
ports) and decodes 64 teacher-forced tokens per mode (see plait.bench.tp_decode for the
modes, the model and the accuracy tolerances), reporting per-token latency (median over
steps, then over repetitions), tokens/s (batch / that latency), time in collectives per
token and its share of the median step (eager modes: wall time inside the two allreduces
of each layer per step, each rank's median over steps, averaged over ranks; it includes
waiting for the slower rank). Medians, because the machine is shared: the means (in the
JSON) follow whatever else runs. And each mode's largest norm-wise relative error of
the logits against the single-process model on the same tokens. Exit status 1 when an
accuracy check (or, with --compile, a graph-break check) fails.

With more ranks x threads than cores (4 ranks on 2 cores) the ranks are oversubscribed:
the report says so, and latencies then measure time slicing as much as communication.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.bench.decoder import DecoderConfig
from plait.bench.tp_decode import EAGER_MODES, TOLERANCE, RunOptions, failures, launch


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(","))


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def _label(r: dict[str, Any]) -> str:
    return r["mode"] + (" (compiled)" if r["compiled"] else "")


def table(result: dict[str, Any]) -> str:
    """A markdown table of one TP launch."""
    over = " (oversubscribed)" if result["oversubscribed"] else ""
    lines = [f"**tp={result['tp']}**, {result['threads_per_rank']} thread(s) per rank on "
             f"{result['cores']} cores{over}, {result['steps']} tokens x {result['reps']} "
             "repetitions", "",
             "| dtype | batch | mode | ms/token | tokens/s | collectives ms/token | "
             "share | rel. error |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        coll = f"{r['coll_ms_per_token']:.3f}" if "coll_ms_per_token" in r else "-"
        share = f"{100 * r['coll_share']:.0f} %" if "coll_share" in r else "-"
        lines.append(f"| {r['dtype']} | {r['batch']} | {_label(r)} | {r['latency_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {coll} | {share} | {r['rel_err']:.2g} |")
    lines.append("")
    for ref in result["reference"]:
        twin = ("" if ref["bf16_vs_fp32"] is None else
                f"; bf16 vs its float32 twin: {ref['bf16_vs_fp32']:.2g}")
        lines.append(f"- single process ({ref['threads']} threads), {ref['dtype']} batch "
                     f"{ref['batch']}: {ref['latency_ms']:.3f} ms/token{twin}")
    for r in result["rows"]:
        if r["compiled"]:
            lines.append(f"- {_label(r)} {r['dtype']} batch {r['batch']}: "
                         f"{r['graph_breaks']} graph breaks, first call {r['compile_s']:.1f} s,"
                         f" vs eager {r['rel_err_vs_eager']:.2g}")
    for mode, why in result["skipped"].items():
        lines.append(f"- {mode}: {why}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Per-token latency, split into time in collectives and the rest, per TP size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.8), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        groups = sorted({(r["dtype"], r["batch"]) for r in res["rows"]})
        labels = list(dict.fromkeys(_label(r) for r in res["rows"]))
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            xs, coll, rest = [], [], []
            for i, g in enumerate(groups):
                row = next((r for r in res["rows"]
                            if (r["dtype"], r["batch"]) == g and _label(r) == label), None)
                if row is None:
                    continue
                c = row.get("coll_ms_per_token", 0.0)
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                coll.append(c)
                rest.append(max(row["latency_ms"] - c, 0.0))
            bars = ax.bar(xs, rest, width, label=label)
            ax.bar(xs, coll, width, bottom=rest, color=bars.patches[0].get_facecolor(),
                   alpha=0.45, hatch="//", edgecolor="black", linewidth=0.3)
        ax.set_xticks(range(len(groups)), [f"{d}\nbatch {b}" for d, b in groups])
        over = ", oversubscribed" if res["oversubscribed"] else ""
        ax.set_title(f"tp={res['tp']} ({res['cores']} cores{over})")
        ax.set_ylabel("median ms per token (hatched: in collectives)")
        ax.legend(fontsize=8)
    cfg = results[0]["config"]
    fig.suptitle(f"TP decode, hidden {cfg['hidden']}, {cfg['layers']} layers, "
                 f"{results[0]['steps']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = DecoderConfig()
    p.add_argument("--tp", type=_ints, default=(2, 4), help="TP sizes (default 2,4)")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--ffn", type=int, default=0, help="MLP width (default 2.75 x hidden)")
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--dtypes", type=_strs, default=("bfloat16", "float32"))
    p.add_argument("--batches", type=_ints, default=(1, 8))
    p.add_argument("--steps", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="per rank (default cores / tp)")
    p.add_argument("--modes", type=_strs, default=EAGER_MODES)
    p.add_argument("--compile", action="store_true",
                   help="also torch.compile the model (functional collectives, plait op)")
    p.add_argument("--json", help="write every launch's results here")
    p.add_argument("--plot", help="write a plot (matplotlib) here")
    a = p.parse_args()
    unknown = [x for x in a.dtypes if x not in TOLERANCE]
    if unknown:
        p.error(f"unknown dtype(s) {unknown}; choose from {list(TOLERANCE)}")
    ffn = a.ffn or (a.hidden * 11 // 4 // 64 * 64)
    cfg = DecoderConfig(hidden=a.hidden, layers=a.layers, heads=a.heads, ffn=ffn,
                        vocab=a.vocab, max_seq=a.steps)
    results, bad = [], []
    for tp in a.tp:
        opts = RunOptions(cfg=cfg, tp=tp, dtypes=a.dtypes, batches=a.batches, steps=a.steps,
                          reps=a.reps, threads=a.threads, compile=a.compile, modes=a.modes)
        with tempfile.TemporaryDirectory() as tmp:
            res = launch(opts, str(Path(tmp) / "result.json"))
        res["command"] = " ".join(["python", *sys.argv])
        results.append(res)
        print(table(res), "\n", flush=True)
        bad += failures(res)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if a.plot:
        plot(results, a.plot)
    for line in bad:
        print("FAILED:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
