"""The options of one ``plait bench`` run: parsed once, frozen, passed to every rank as JSON."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..config import parse_size

OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce",
       "gather", "scatter", "sendrecv")
"""Every collective the benchmark knows, in nccl-tests' order of importance."""

APIS = ("plait", "torch")
COMPARE = ("gloo", "mpi")
REDOPS = ("sum", "prod", "min", "max", "avg")

# nccl-tests' type names (-d float, half, ...) and numpy's (float32, float16, ...)
DTYPE_ALIASES = {
    "float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
    "bfloat16": "bfloat16", "double": "float64", "float64": "float64", "int8": "int8",
    "uint8": "uint8", "int32": "int32", "int": "int32", "int64": "int64",
}


@dataclass(frozen=True)
class BenchOptions:
    nranks: int = 2
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    ops: tuple[str, ...] = ("allreduce",)
    dtype: str = "float32"
    redop: str = "sum"
    root: int = 0
    warmup: int = 5
    iters: int = 20
    check: int = 1
    reps: int = 5
    api: str = "plait"
    compare: tuple[str, ...] = ()
    json: str | None = None
    plot: str | None = None
    progress: bool = False
    command: str = ""
    launcher: str = ""

    def sizes(self) -> list[int]:
        """Byte sizes of the sweep: min_bytes, times factor, ... up to max_bytes."""
        out = []
        s = self.min_bytes
        while s <= self.max_bytes:
            out.append(s)
            if self.factor <= 1:
                break
            s *= self.factor
        return out

    def backends(self) -> list[str]:
        """Measured backends, plait's first: ``plait`` or ``plait-torch``, then compared."""
        return ["plait" if self.api == "plait" else "plait-torch", *self.compare]

    def validate(self) -> None:
        if self.nranks < 1:
            raise ValueError(f"-n {self.nranks}: at least 1 rank")
        if self.min_bytes < 1 or self.max_bytes < self.min_bytes:
            raise ValueError(f"-b {self.min_bytes} -e {self.max_bytes}: need 1 <= -b <= -e")
        if self.factor < 2:
            raise ValueError(f"-f {self.factor}: the size factor must be at least 2")
        for op in self.ops:
            if op not in OPS:
                raise ValueError(f"--ops: unknown collective {op!r} (known: {', '.join(OPS)}, all)")
        if self.dtype not in DTYPE_ALIASES.values():
            raise ValueError(f"-d {self.dtype!r}: expected one of {', '.join(DTYPE_ALIASES)}")
        if self.redop not in REDOPS:
            raise ValueError(f"-o {self.redop!r}: expected one of {', '.join(REDOPS)}")
        if self.redop == "avg" and not self.dtype.startswith(("float", "bfloat")):
            raise ValueError(f"-o avg needs a floating type, not -d {self.dtype}")
        if self.warmup < 0 or self.iters < 1 or self.check < 0 or self.reps < 1:
            raise ValueError("-w >= 0, -i >= 1, -c >= 0 and --reps >= 1 are required")
        if self.api not in APIS:
            raise ValueError(f"--api {self.api!r}: expected plait or torch")
        for c in self.compare:
            if c not in COMPARE:
                raise ValueError(f"--compare {c!r}: expected gloo, mpi or gloo,mpi")
        if self.root < 0:
            raise ValueError(f"--root {self.root}: must be >= 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchOptions:
        raw = json.loads(text)
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in raw.items() if k in names}
        for k in ("ops", "compare"):
            kw[k] = tuple(kw.get(k, ()))
        return cls(**kw)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip().lower() for t in text.split(",") if t.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchOptions()
    a = parser.add_argument
    a("-n", "--nranks", type=int, default=d.nranks,
      help="local ranks to launch when not started by torchrun/mpirun (default %(default)s)")
    a("-b", "--minbytes", default="8", help="smallest size in bytes, e.g. 8, 1K, 4M (default 8)")
    a("-e", "--maxbytes", default="64M", help="largest size in bytes (default 64M)")
    a("-f", "--stepfactor", type=int, default=d.factor,
      help="multiply the size by this factor between rows (default %(default)s)")
    a("--ops", default="allreduce",
      help=f"comma-separated collectives or 'all' ({', '.join(OPS)}; default allreduce)")
    a("-d", "--datatype", default=d.dtype,
      help="element type: float32 (float), float16 (half), bfloat16, float64 (double), int8, "
           "uint8, int32, int64 (default float32)")
    a("-o", "--op", default=d.redop, help=f"reduce op: {', '.join(REDOPS)} (default sum)")
    a("--root", type=int, default=d.root, help="root rank of rooted collectives (default 0)")
    a("-w", "--warmup_iters", type=int, default=d.warmup,
      help="warm-up iterations per backend and mode (default %(default)s)")
    a("-i", "--iters", type=int, default=d.iters,
      help="timed iterations per repetition (default %(default)s)")
    a("-c", "--check", type=int, default=d.check,
      help="checked iterations per backend and mode, exact data (default %(default)s; 0: none)")
    a("--reps", type=int, default=d.reps,
      help="repetitions, backends interleaved; times are medians over them (default %(default)s)")
    a("--api", choices=APIS, default=d.api,
      help="plait's own API, or torch.distributed on the plait backend (default plait)")
    a("--compare", default="",
      help="also run the sweep on these backends in the same processes: gloo, mpi or gloo,mpi")
    a("--json", metavar="FILE", help="write every row and the environment as JSON")
    a("--plot", metavar="FILE.png", help="plot bus bandwidth and latency against size "
      "(needs matplotlib: pip install 'plait[plot]')")


def from_args(args: argparse.Namespace) -> BenchOptions:
    """Validated options from the parsed command line (ValueError on a bad value)."""
    ops = _csv(args.ops)
    if ops == ("all",):
        ops = OPS
    dtype = DTYPE_ALIASES.get(args.datatype.lower(), args.datatype.lower())
    compare = tuple(c for c in _csv(args.compare) if c != "none")
    opts = BenchOptions(
        nranks=args.nranks, min_bytes=parse_size(args.minbytes),
        max_bytes=parse_size(args.maxbytes), factor=args.stepfactor, ops=ops, dtype=dtype,
        redop=args.op.lower(), root=args.root, warmup=args.warmup_iters, iters=args.iters,
        check=args.check, reps=args.reps, api=args.api, compare=tuple(dict.fromkeys(compare)),
        json=os.path.abspath(args.json) if args.json else None,
        plot=os.path.abspath(args.plot) if args.plot else None)
    opts.validate()
    return opts
