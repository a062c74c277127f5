"""``plait testbed``: build an emulated cluster, run a command on every host, tear down.

    plait testbed --hosts 2 --rails 2 --rate 200mbit,100mbit --ecmp --ranks-per-host 2 \\
        -- python -m some.module args
    plait testbed --check          # can this machine build one? why not?
    plait testbed --hosts 2        # no command: build, print the layout, wait for Ctrl-C
    plait testbed --cleanup        # delete namespaces left by killed (SIGKILL) runs
"""

from __future__ import annotations

import argparse
import sys
import time

from plait.testbed.cluster import Cluster, TestbedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--rails", type=int, default=2, help="rails (NICs) per host (default 2)")
    parser.add_argument(
        "--rate", default="200mbit",
        help="tbf rate per rail, one for all or comma-separated per rail, e.g. 200mbit,100mbit; "
             "'none' for unshaped (default 200mbit)",
    )
    parser.add_argument("--ecmp", action="store_true",
                        help="give each host a host address reached over every rail (ECMP)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="processes started on every host (default 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill every rank after this many seconds (default: none)")
    parser.add_argument("--check", action="store_true",
                        help="print whether this machine can build a cluster, and why not")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete namespaces left behind by testbed runs that were killed")
    parser.add_argument("argv", metavar="command", nargs=argparse.REMAINDER,
                        help="command to run on every host (after --)")


def run(args: argparse.Namespace) -> int:
    if args.check:
        ok, reason = Cluster.available()
        print(("yes: " if ok else "no: ") + reason)
        return 0 if ok else 1
    if args.cleanup:
        removed = Cluster.cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)" + "".join(f"\n  {n}" for n in removed))
        return 0
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    rate = None if args.rate.strip().lower() == "none" else args.rate
    try:
        cluster = Cluster(hosts=args.hosts, rails=args.rails, rate=rate, ecmp=args.ecmp)
    except ValueError as exc:
        print(f"plait testbed: {exc}", file=sys.stderr)
        return 2
    ok, reason = Cluster.available()
    if not ok:
        print(f"plait testbed: cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 1
    try:
        with cluster:
            print(cluster.describe(), file=sys.stderr, flush=True)
            if not command:
                print("no command given: the cluster stays up until Ctrl-C; enter a host with\n"
                      f"  ip netns exec {cluster.netns(0)} bash", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
            res = cluster.launch(command, args.ranks_per_host, timeout=args.timeout,
                                 capture=False)
            if res.ok:
                return 0
            print(f"plait testbed: {res.summary()}", file=sys.stderr)
            if res.timed_out:
                return 124
            code = res.ranks[res.first_failure].returncode if res.first_failure is not None else 1
            if code is None or code == 0:
                return 1
            return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
    except KeyboardInterrupt:
        print("plait testbed: interrupted; every rank killed and the cluster torn down",
              file=sys.stderr)
        return 130
    except TestbedError as exc:
        print(f"plait testbed: {exc}", file=sys.stderr)
        return 1
