"""What ``plait bench`` shows: the nccl-tests-style table, the JSON record, the plot, and a
progress bar on stderr.

JSON format ``plait-bench/1`` (one object):

- ``format``, ``command`` (the command line), ``options`` (every option, resolved),
- ``environment``: CPU model, cores, host, OS, Python/numpy/torch/plait/MPI versions,
  launcher, ranks, backends measured and skipped (with the reason), copy-bandwidth samples,
- ``copy_bandwidth_gbps``: median single-thread copy bandwidth measured in the same run,
- ``rows``: one per (operation, size, backend) with ``op, size, count, type, redop, root,
  backend, bus_factor, algorithm`` (plait's selected algorithm, null where unknown),
  ``out_of_place`` and ``in_place`` (null where the operation has no such form), each
  ``{time_us, algbw_gbps, busbw_gbps, wrong, samples_us}`` or ``{skipped: reason}``, and on
  plait's rows ``speedup`` {backend: other's time / plait's time},
- ``summary``: ``wrong`` (total), ``allreduce_max`` (plait's largest allreduce: size, busbw,
  fraction of copy bandwidth).

Times are microseconds per call, medians over repetitions of the rank-averaged batch time;
bandwidths are GB/s (1e9 bytes/s) as in nccl-tests.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from .options import BenchOptions
from .results import Measurement, Row

if TYPE_CHECKING:
    from .backends import Backend

FORMAT = "plait-bench/1"


def human_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def primary_mode(row: Row, label: str, other: str | None = None) -> str:
    """The mode a comparison uses: in-place where both sides measured it, else out-of-place
    (plait's allreduce, reduce and broadcast are in place by API; out-of-place adds a copy)."""
    labels = [label] + ([other] if other else [])
    ins = [row.results[x].get("in") for x in labels]
    if all(m is not None and m.time_us is not None for m in ins):
        return "in"
    return "out"


def speedup(row: Row, plait_label: str, other: str) -> float | None:
    mode = primary_mode(row, plait_label, other)
    mine = row.results[plait_label].get(mode)
    theirs = row.results[other].get(mode)
    if mine is None or theirs is None or not mine.time_us or not theirs.time_us:
        return None
    return theirs.time_us / mine.time_us


class Progress:
    """A one-line progress bar, redrawn in place on a terminal."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self.stream, self.total, self.done, self.what = stream, max(total, 1), 0, ""
        self.t0 = time.monotonic()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.t0
        self.stream.write(f"\r\033[K[{bar}] {self.done}/{self.total} {self.what} "
                          f"({elapsed:.0f} s)")
        self.stream.flush()

    def update(self, what: str) -> None:
        self.what = what
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def clear(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()

    def redraw(self) -> None:
        self._draw()

    def close(self) -> None:
        self.clear()


def _num(v: float | None, width: int, prec: int = 2) -> str:
    if v is None:
        return f"{'N/A':>{width}}"
    if abs(v) >= 10 ** (width - prec - 2):
        return f"{v:{width}.0f}"
    return f"{v:{width}.{prec}f}"


class TablePrinter:
    """Prints the header, each row as soon as it is measured, and the footer (rank 0)."""

    def __init__(self, opts: BenchOptions, size: int, labels: list[str], out: TextIO,
                 progress: Progress | None = None) -> None:
        self.opts, self.size, self.labels, self.out = opts, size, labels, out
        self.plait = labels[0]
        self.others = labels[1:]
        self.progress = progress
        self.pending: list[Row] = []  # this operation's rows, for the compared tables
        self.current_op: str | None = None

    def _print(self, text: str) -> None:
        # the bar shares the terminal only when stdout is one too
        bar = self.progress if self.progress is not None and _isatty(self.out) else None
        if bar is not None:
            bar.clear()
        print(text.rstrip(), file=self.out, flush=True)
        if bar is not None:
            bar.redraw()

    def header(self, launcher: str, skipped: dict[str, str]) -> None:
        o = self.opts
        p = self._print
        p(f"# plait bench: {self.size} ranks ({launcher}), api {o.api}, "
          f"compare {','.join(o.compare) or 'none'}")
        p(f"# sizes {o.min_bytes} B .. {o.max_bytes} B x{o.factor}, type {o.dtype}, "
          f"warm-up {o.warmup}, {o.reps} repetitions x {o.iters} timed iterations, "
          f"{o.check} checked")
        for name, why in skipped.items():
            p(f"# {name} skipped: {why}")
        if self.others:
            p("# speed-up = other backend's time / plait's time, in-place where both have it, "
              "else out-of-place (> 1: plait is faster)")
        p("#")

    def _columns(self, primary: bool) -> list[str]:
        head1 = f"#{'':51}{'out-of-place':^32}{'in-place':^32}"
        head2 = (f"#{'size':>11}{'count':>14}{'type':>10}{'redop':>8}{'root':>8}"
                 + (f"{'time':>9}{'algbw':>8}{'busbw':>8}{'#wrong':>7}") * 2)
        head3 = (f"#{'(B)':>11}{'(elements)':>14}{'':26}"
                 + (f"{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}{'':7}") * 2)
        if primary:
            for o in self.others:
                head1 += f"{'speed-up':>10}"
                head2 += f"{'x ' + o:>10}"
            head2 += "  algorithm"
        return [head1, head2, head3]

    def _line(self, row: Row, label: str, primary: bool) -> str:
        text = (f"{row.size:>12}{row.count:>14}{row.dtype:>10}{row.redop or 'none':>8}"
                f"{-1 if row.root is None else row.root:>8}")
        for mode in ("out", "in"):
            m = row.results[label].get(mode)
            if m is None or m.time_us is None:
                text += f"{'N/A':>9}{'N/A':>8}{'N/A':>8}{'N/A':>7}"
                continue
            t = m.time_us
            text += (f"{_num(t, 9)}{_num(row.algbw(t), 8)}{_num(row.busbw(t), 8)}"
                     f"{m.wrong:>7}")
        if primary:
            for o in self.others:
                s = speedup(row, label, o)
                text += f"{'N/A':>10}" if s is None else f"{s:>9.2f}x"
            text += f"  {row.algorithm or '-'}"
        return text

    def row(self, row: Row) -> None:
        if row.op != self.current_op:
            self._flush_compared()
            self.current_op = row.op
            self._print(f"# {row.op} — {self.plait}")
            for h in self._columns(True):
                self._print(h)
        self.pending.append(row)
        self._print(self._line(row, self.plait, True))

    def _flush_compared(self) -> None:
        if not self.pending:
            return
        op = self.pending[0].op
        for o in self.others:
            self._print("#")
            self._print(f"# {op} — {o} (same run, interleaved)")
            for h in self._columns(False):
                self._print(h)
            for r in self.pending:
                self._print(self._line(r, o, False))
            notes = {m.skipped for r in self.pending for m in r.results[o].values() if m.skipped}
            for n in sorted(notes):
                self._print(f"#   N/A: {n}")
        self.pending = []
        self._print("#")

    def footer(self, rows: list[Row], copy_gbps: float, wrong: int) -> None:
        self._flush_compared()
        p = self._print
        p(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        for label in self.labels:
            bws = []
            for r in rows:
                m = r.results[label].get(primary_mode(r, label))
                if m is not None and m.time_us:
                    bws.append(r.busbw(m.time_us) or 0.0)
            if bws:
                p(f"# Avg bus bandwidth    : {statistics.mean(bws):.3f} GB/s ({label})")
        p(f"# Single-thread copy bandwidth (np.copyto, 64 MiB, this run): {copy_gbps:.2f} GB/s")
        best = allreduce_max(rows, self.plait, copy_gbps)
        if best is not None:
            p(f"# {self.plait} allreduce {human_size(best['size'])}: busbw "
              f"{best['busbw_gbps']:.2f} GB/s = {100 * best['fraction_of_copy']:.0f} % of "
              "single-thread copy bandwidth"
              + (" (each of 2 ranks moves ~2.5x the buffer through memory: ~40 % is the "
                 "practical ceiling)" if self.size == 2 else ""))
        for o in self.others:
            ratios = [s for r in rows if (s := speedup(r, self.plait, o)) is not None]
            if ratios:
                p(f"# speed-up over {o}: median {statistics.median(ratios):.2f}x, "
                  f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} rows")


def allreduce_max(rows: list[Row], label: str, copy_gbps: float) -> dict[str, Any] | None:
    """plait's largest measured allreduce and the fraction of copy bandwidth it reaches."""
    cands = [r for r in rows if r.op == "allreduce"]
    if not cands:
        return None
    r = max(cands, key=lambda x: x.size)
    mode = primary_mode(r, label)
    m = r.results[label].get(mode)
    if m is None or not m.time_us:
        return None
    bw = r.busbw(m.time_us) or 0.0
    return {"size": r.size, "mode": mode, "busbw_gbps": bw,
            "fraction_of_copy": bw / copy_gbps if copy_gbps else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(opts: BenchOptions, size: int, launcher: str, backends: list[Backend],
                skipped: dict[str, str], copy_samples: list[float]) -> dict[str, Any]:
    import numpy
    import torch

    versions: dict[str, str] = {"python": platform.python_version(),
                                "numpy": numpy.__version__, "torch": torch.__version__}
    for b in backends:
        versions.update(b.versions())
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "cpu_affinity": affinity,
        "host": socket.gethostname(), "platform": platform.platform(),
        "versions": versions, "launcher": launcher, "ranks": size,
        "backends": [b.label for b in backends], "skipped": skipped,
        "copy_bandwidth_samples_gbps": copy_samples,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _mode_json(row: Row, m: Measurement | None) -> dict[str, Any] | None:
    if m is None:
        return None
    if m.skipped or m.time_us is None:
        return {"skipped": m.skipped or "not measured"}
    t = m.time_us
    return {"time_us": t, "algbw_gbps": row.algbw(t), "busbw_gbps": row.busbw(t),
            "wrong": m.wrong, "samples_us": m.samples_us}


def to_json(opts: BenchOptions, env: dict[str, Any], rows: list[Row],
            copy_gbps: float) -> dict[str, Any]:
    labels = list(rows[0].results) if rows else []
    out_rows = []
    for r in rows:
        for i, label in enumerate(labels):
            ms = r.results[label]
            rec: dict[str, Any] = {
                "op": r.op, "size": r.size, "count": r.count, "type": r.dtype,
                "redop": r.redop, "root": r.root, "backend": label,
                "bus_factor": r.bus_factor,
                "algorithm": r.algorithm if i == 0 else None,
                "out_of_place": _mode_json(r, ms.get("out")),
                "in_place": _mode_json(r, ms.get("in")),
            }
            if i == 0:
                rec["speedup"] = {o: speedup(r, label, o) for o in labels[1:]}
            out_rows.append(rec)
    wrong = sum(m.wrong for r in rows for ms in r.results.values() for m in ms.values())
    return {
        "format": FORMAT, "command": opts.command, "options": json.loads(opts.to_json()),
        "environment": env, "copy_bandwidth_gbps": copy_gbps, "rows": out_rows,
        "summary": {"wrong": wrong,
                    "allreduce_max": allreduce_max(rows, labels[0], copy_gbps)
                    if labels else None},
    }


def write_json(path: str, opts: BenchOptions, env: dict[str, Any], rows: list[Row],
               copy_gbps: float) -> None:
    data = to_json(opts, env, rows, copy_gbps)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def plot_available() -> str | None:
    """None if matplotlib can be imported, else what to install."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'plait[plot]'"
    return None


def plot(path: str, rows: list[Row], labels: list[str], size: int) -> None:
    """Bus bandwidth and latency against size, log-log, one line per backend, per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ops = list(dict.fromkeys(r.op for r in rows))
    if not ops:
        return
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
    for (ax_bw, ax_t), op in zip(axes, ops, strict=True):
        op_rows = [r for r in rows if r.op == op]
        for label in labels:
            xs, bws, ts = [], [], []
            for r in op_rows:
                m = r.results[label].get(primary_mode(r, label))
                if m is not None and m.time_us:
                    xs.append(r.size)
                    bws.append(r.busbw(m.time_us))
                    ts.append(m.time_us)
            if xs:
                ax_bw.plot(xs, bws, marker="o", ms=3, label=label)
                ax_t.plot(xs, ts, marker="o", ms=3, label=label)
        for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time per call (us)")):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _tick(x)))
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            ax.set_title(f"{op}, {size} ranks")
    fig.tight_layout()
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _tick(x: float) -> str:
    n = round(x)
    return human_size(n).replace(" ", "") if n >= 1 and abs(n - x) < 1e-6 else ""


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def stderr_is_terminal() -> bool:
    return _isatty(sys.stderr)
