"""Entry point of the ``plait`` console script.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("plait.cli.demo", "launch local ranks, run every collective on both transports"),
    "bench": ("plait.bench.cli", "nccl-tests-style benchmark, with gloo and MPI side by side"),
    "topo": ("plait.cli.topo", "print the job's topology (hosts, ranks, rails)"),
    "testbed": ("plait.testbed.cli", "emulate a multi-host cluster with network namespaces"),
    "config": ("plait.cli.config", "print plait's settings and their documentation"),
    "flightrec": ("plait.cli.flightrec", "print flight records dumped on a timeout or failure"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="plait", description="plait collective communication")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (modname, helptext) in COMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name is not None and modname.startswith(exc.name):
                continue  # command not built yet
            raise
        p = sub.add_parser(name, help=helptext, description=helptext)
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
