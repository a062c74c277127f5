"""Entry of one rank started by ``plait bench``'s own launcher: ``python -m plait.bench._worker
OPTIONS_JSON``."""

from __future__ import annotations

import sys

from .loop import worker
from .options import BenchOptions
from .setup import launcher_rank


def main(argv: list[str]) -> int:
    opts = BenchOptions.from_json(argv[0])
    found = launcher_rank()
    if found is None:
        print("plait bench worker: no RANK/WORLD_SIZE (or mpirun) variables", file=sys.stderr)
        return 2
    rank, size, launcher = found
    return worker(opts, rank, size, opts.launcher or launcher)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
