"""``plait config``: print every setting, its current value, where the value comes from and
what it does — all generated from the declarations in :mod:`plait.config`."""

from __future__ import annotations

import argparse
import json

from ..config import SETTINGS, Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per setting (variable, value, source, agree, doc)")


def run(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    rows = cfg.describe()
    if args.json:
        for (var, value, doc), s in zip(rows, SETTINGS.values(), strict=True):
            print(json.dumps({"variable": var, "value": value, "source": cfg.source(s.name),
                              "agree": s.agree, "doc": doc}))
        return 0
    width = max(len(var) for var, _, _ in rows)
    print(f"{'VARIABLE':{width}}   {'VALUE':14} {'SOURCE':8} DOCUMENTATION")
    for (var, value, doc), s in zip(rows, SETTINGS.values(), strict=True):
        # "=" marks the settings every rank of a communicator must agree on.
        mark = "=" if s.agree else " "
        print(f"{var:{width}} {mark} {value:14} {cfg.source(s.name) or '':8} {doc}")
    print("\n= : every rank of a communicator must have the same value")
    return 0
