"""``plait flightrec FILE...``: print flight records written on a timeout or failure
(``PLAIT_FLIGHT_RECORDER_DIR``), one table per rank, newest operation last."""

from __future__ import annotations

import argparse
import json

from ..flightrec import format_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="plait-flightrec-*.json files")
    parser.add_argument("-n", "--last", type=int, default=32,
                        help="operations to show per rank (default 32)")


def run(args: argparse.Namespace) -> int:
    dumps = []
    for path in args.files:
        with open(path) as f:
            dumps.append(json.load(f))
    for d in sorted(dumps, key=lambda d: d.get("rank", 0)):
        print(f"rank {d.get('rank')} (pid {d.get('pid')}), communicator "
              f"{d.get('communicator')}: {d.get('reason')}")
        print(format_records(d.get("records", []), args.last))
    return 0
