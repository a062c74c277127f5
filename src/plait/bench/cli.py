"""``plait bench``: an nccl-tests-style benchmark of plait, with gloo and MPI side by side.

Examples::

    plait bench                                   # allreduce, 8 B .. 64 MiB, 2 local ranks
    plait bench --ops all -b 1K -e 16M --compare gloo,mpi --json out.json --plot out.png
    torchrun --nproc-per-node 4 -m plait.bench --api torch --compare gloo
    mpirun --allow-run-as-root --oversubscribe -n 2 python -m plait.bench --compare mpi

Exit status: 0, or 1 when any result was wrong (#wrong > 0), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace

from . import options, report
from .launch import launch
from .loop import worker
from .setup import launcher_rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2]
    options.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        opts = options.from_args(args)
    except ValueError as exc:
        print(f"plait bench: {exc}", file=sys.stderr)
        return 2
    if opts.plot:
        missing = report.plot_available()
        if missing:
            print(f"plait bench: {missing}", file=sys.stderr)
            return 2
    opts = replace(opts, progress=report.stderr_is_terminal(),
                   command=shlex.join(["plait", "bench", *_argv_tail()]))
    found = launcher_rank()
    if found is not None:
        rank, size, launcher = found
        return worker(opts, rank, size, launcher)
    return launch(opts)


def _argv_tail() -> list[str]:
    """The arguments after ``bench`` on this process's command line (for the JSON record)."""
    argv = sys.argv[1:]
    return argv[argv.index("bench") + 1:] if "bench" in argv else argv


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench [options]``: the same as ``plait bench``."""
    parser = argparse.ArgumentParser(prog="python -m plait.bench",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
