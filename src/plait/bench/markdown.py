"""Markdown tables from ``plait bench --json`` output (for docs/PERFORMANCE.md).

    python -m plait.bench.markdown bench.json [more.json ...]

One table per operation: size, then per backend the time (us) and bus bandwidth (GB/s) of
the mode the speed-up uses (in-place where both sides have it), then plait's speed-up.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .report import human_size


def _mode(row: dict[str, Any], other: dict[str, Any] | None) -> str:
    def ok(r: dict[str, Any] | None) -> bool:
        return r is not None and r.get("in_place") is not None and "time_us" in r["in_place"]

    return "in_place" if ok(row) and (other is None or ok(other)) else "out_of_place"


def tables(data: dict[str, Any]) -> str:
    env = data["environment"]
    labels: list[str] = env["backends"]
    me, others = labels[0], labels[1:]
    by_key = {(r["op"], r["size"], r["backend"]): r for r in data["rows"]}
    ops = list(dict.fromkeys(r["op"] for r in data["rows"]))
    out = [f"{env['ranks']} ranks, {env['cpu_model']} ({env['cpu_count']} cores), "
           f"`{data['command']}`", ""]
    for op in ops:
        head = ["size"]
        for label in labels:
            head += [f"{label} us", f"{label} GB/s"]
        head += [f"x {o}" for o in others]
        out += [f"**{op}** (time per call and bus bandwidth; speed-up = other's time / "
                f"{me}'s)", "", "| " + " | ".join(head) + " |",
                "|" + "---:|" * len(head)]
        for size in sorted({r["size"] for r in data["rows"] if r["op"] == op}):
            mine = by_key[op, size, me]
            cells = [human_size(size)]
            for label in labels:
                r = by_key[op, size, label]
                ref = by_key[op, size, others[0]] if others and label == me else mine
                m = r[_mode(r, ref if label == me else mine)]
                if m is None or "time_us" not in m:
                    cells += ["n/a", "n/a"]
                else:
                    cells += [f"{m['time_us']:.1f}", f"{m['busbw_gbps']:.3g}"]
            for o in others:
                s = mine.get("speedup", {}).get(o)
                cells.append("n/a" if s is None else f"{s:.2f}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    best = data["summary"].get("allreduce_max")
    out.append(f"Single-thread copy bandwidth in the same run: "
               f"{data['copy_bandwidth_gbps']:.2f} GB/s.")
    if best:
        out.append(f"{me} allreduce of {human_size(best['size'])}: "
                   f"{best['busbw_gbps']:.2f} GB/s bus bandwidth = "
                   f"{100 * best['fraction_of_copy']:.0f} % of it.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for p in paths:
        with open(p) as f:
            print(tables(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
