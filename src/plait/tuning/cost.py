"""The cost model: latency (alpha, s) and inverse bandwidth (beta, s/byte) per link class
(shared memory, two hosts on one switch, two hosts on different switches), and a
prediction of each algorithm's time from its schedule.

Prediction: every rank's schedule is laid out (ranks host by host, as the communicator's
ring order does; ``hosts`` hosts of ``local`` ranks, spread evenly over ``switches``).
Step k's messages are the Sends in every rank's step k. A network message leaves on its
sender's rail (local rank modulo rails) and enters on its receiver's; messages that share
a rail of a host in one direction share its bandwidth. Step time = the slowest message,
alpha + bytes * beta * (messages sharing its busiest rail); the schedule's time is the sum
of its steps. Hierarchical algorithms are the sum of their phases, each predicted the same
way on its sub-communicator's shape (the rail phase runs L sub-communicators at once, so
ceil(L / rails) of them share each rail). Reductions and local copies are not counted.

Calibration (``calibrate``) fits alpha and beta of one link class by least squares to a
``plait bench --json`` run whose messages all cross that class (one host: shm; one rank
per host: switch), using the same per-schedule step and byte counts, so that the model
and the measurements speak the same language. ``python -m plait.tuning.cost calibrate
bench.json --class shm`` prints the ``[links.<class>]`` table for a topology file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..algorithms import registry
from ..algorithms.schedule import Schedule, Send


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # seconds per byte


DEFAULT_SHM = Link(5e-6, 1 / 3e9)
"""Shared memory here: ~5 us per exchange, ~3 GB/s per copy (docs/PERFORMANCE.md)."""
DEFAULT_NET = Link(50e-6, 8 / 10e9)
"""A 10 Gbit/s link and a Python TCP round trip, when nothing better is known."""
CROSS_SWITCH_LATENCY = 2.0
"""Without a figure for it, a message between switches takes two hops' latency."""


@dataclass(frozen=True)
class Model:
    shm: Link = DEFAULT_SHM
    switch: Link = DEFAULT_NET
    cross_switch: Link = Link(DEFAULT_NET.alpha * CROSS_SWITCH_LATENCY, DEFAULT_NET.beta)

    @classmethod
    def from_topology(cls, topo: Any) -> Model:
        """Links from the topology file's ``links`` table, the rails' bandwidth, or the
        discovered link speed, in that order; defaults for what none of them gives."""
        def link(name: str, default: Link, bw_fallback: float | None) -> Link:
            lc = topo.link(name)
            bw = lc.bandwidth or bw_fallback
            return Link(lc.latency if lc.latency is not None else default.alpha,
                        8.0 / bw if bw else default.beta)

        rail_bw = topo.rail_bandwidth()
        shm = link("shm", DEFAULT_SHM, None)
        sw = link("switch", DEFAULT_NET, rail_bw)
        xdefault = Link(sw.alpha * CROSS_SWITCH_LATENCY, sw.beta)
        xs = link("cross_switch", xdefault, topo.link("switch").bandwidth or rail_bw)
        return cls(shm, sw, xs)


@dataclass(frozen=True)
class Shape:
    """A communicator as the model sees it."""

    hosts: int
    local: int  # ranks per host
    rails: int = 1  # rails per host (0 or 1: one NIC)
    switches: int = 1

    @property
    def size(self) -> int:
        return self.hosts * self.local


# -- schedules of every rank ---------------------------------------------------------------


def schedules(op: str, algo: str, n: int, nbytes: int) -> list[Schedule] | None:
    """Every rank's schedule of a flat algorithm, in bytes (elements of one byte), planned
    as the executor plans it (``registry.model_args``); None for an algorithm without a
    schedule (HOST and COMPOSITE kinds). ValueError for an unknown algorithm.

    The plans go through the algorithms' lru caches, which the communicators' own
    operations use too: the model's entries can push theirs out, but only while decisions
    are being made (``selector.choose`` caches each one), not in a steady state."""
    alg = registry.get(op, algo)
    if alg.plan is None:
        return None
    return [alg.plan(op, registry.model_args(op, r, n, nbytes)) for r in range(n)]


def schedule_time(scheds: Sequence[Schedule], shape: Shape, model: Model,
                  share: int = 1) -> float:
    """Predicted time of one flat algorithm (its schedules for every rank). ``share``: how
    many such operations run at once on every rail (hierarchical rail phases)."""
    L = max(1, shape.local)
    rails = max(1, shape.rails)
    hps = max(1, math.ceil(shape.hosts / max(1, shape.switches)))
    steps: dict[int, list[tuple[int, int, int]]] = {}
    for r, s in enumerate(scheds):
        for k, st in enumerate(s.steps):
            for x in st.xfers:
                if isinstance(x, Send):
                    steps.setdefault(k, []).append((r, x.peer, x.count))
    total = 0.0
    for k in sorted(steps):
        load: dict[tuple[int, int, int], int] = {}
        flows = steps[k]
        for src, dst, _ in flows:
            hs, hd = src // L, dst // L
            if hs != hd:
                for key in ((hs, (src % L) % rails, 0), (hd, (dst % L) % rails, 1)):
                    load[key] = load.get(key, 0) + 1
        worst = 0.0
        for src, dst, nb in flows:
            hs, hd = src // L, dst // L
            if hs == hd:
                t = model.shm.alpha + nb * model.shm.beta
            else:
                link = model.switch if hs // hps == hd // hps else model.cross_switch
                busy = max(load[(hs, (src % L) % rails, 0)], load[(hd, (dst % L) % rails, 1)])
                t = link.alpha + nb * link.beta * busy * share
            worst = max(worst, t)
        total += worst
    return total


def direct_time(op: str, n: int, nbytes: int, model: Model) -> float:
    """The direct shared-memory algorithms: every rank writes its slot, then reads what it
    needs from the others' slots (two synchronisations)."""
    return 2 * model.shm.alpha + nbytes * model.shm.beta * (1 + (n - 1) / max(n, 1))


def inplace_time(n: int, nbytes: int, model: Model) -> float:
    """Allreduce in place: read (n-1)/n of the buffer from peers to reduce this rank's
    slice, then read the (n-1)/n other slices (four synchronisations, one copy each)."""
    n = max(n, 1)
    return 4 * model.shm.alpha + nbytes * model.shm.beta * (2 * (n - 1) / n + 1 / n)


def slices_time(n: int, nbytes: int, model: Model) -> float:
    """Allreduce by slices: write the piece, reduce 1/n of it from every slot, copy all n
    reduced slices (three synchronisations; about 3 S of memory traffic per rank, where
    direct reads all n rows)."""
    return 3 * model.shm.alpha + nbytes * model.shm.beta * (2 + 1 / max(n, 1))


def flat_time(op: str, algo: str, nbytes: int, shape: Shape, model: Model,
              share: int = 1) -> float:
    try:
        kind = registry.get(op, algo).kind
    except ValueError:
        kind = None
    if kind == registry.HOST:
        if algo == "slices":
            return slices_time(shape.size, nbytes, model)
        if algo == "inplace":
            return inplace_time(shape.size, nbytes, model)
        return direct_time(op, shape.size, nbytes, model)
    sch = schedules(op, algo, shape.size, nbytes) if kind == registry.SCHEDULE else None
    if sch is None:  # unknown, or COMPOSITE: selector.estimate asks hier_time for those
        raise ValueError(f"no model for {op} algorithm {algo!r}")
    return schedule_time(sch, shape, model, share)


# -- hierarchical ------------------------------------------------------------------------


PhaseChooser = Callable[[str, int, Shape], str]
"""(op, nbytes, sub shape) -> the flat algorithm the selector would run there."""


def hier_time(op: str, nbytes: int, shape: Shape, model: Model, choose: PhaseChooser
              ) -> float:
    """The sum of the phases of ``algorithms/hier.py``."""
    H, L = shape.hosts, shape.local
    local = Shape(1, L, shape.rails, 1)
    rail = Shape(H, 1, 1, shape.switches)
    share = math.ceil(L / max(1, shape.rails))

    def ph(o: str, nb: int, sh: Shape, sharing: int = 1) -> float:
        return flat_time(o, choose(o, nb, sh), nb, sh, model, sharing)

    part = -(-nbytes // L)
    if op == "allreduce":
        return (ph("reduce_scatter", nbytes, local) + ph("allreduce", part, rail, share)
                + ph("allgather", nbytes, local))
    if op == "broadcast":
        return (ph("broadcast", nbytes, local) + ph("broadcast", part, rail, share)
                + ph("allgather", nbytes, local))
    if op in ("allgather", "allgatherv"):
        return (ph("allgather", part, rail, share) + ph("allgather", nbytes, local)
                + nbytes * model.shm.beta)
    if op == "reduce_scatter":
        return ph("reduce_scatter", nbytes, local) + ph("reduce_scatter", part, rail, share) \
            + nbytes * model.shm.beta
    if op in ("alltoall", "alltoallv"):
        return (ph("alltoall", nbytes, local) + ph("alltoall", nbytes, rail, share)
                + 2 * nbytes * model.shm.beta)
    raise ValueError(f"no hierarchical {op}")


# -- calibration -------------------------------------------------------------------------


def calibrate(data: dict[str, Any], link_class: str = "shm", backend: str | None = None,
              hosts: int | None = None) -> Link:
    """Fit alpha, beta of ``link_class`` to a ``plait bench --json`` run (plait's rows,
    out-of-place times, the algorithm each row reports). ``hosts``: the run's hosts (by
    default 1 for shm, one rank per host otherwise)."""
    rows = [r for r in data["rows"] if r.get("algorithm") and r.get("out_of_place")
            and r["out_of_place"].get("time_us") and (backend is None or r["backend"] == backend)]
    if not rows:
        raise ValueError("no plait rows with an algorithm and a time in this file")
    n = int(data.get("environment", {}).get("world_size")
            or data.get("options", {}).get("nranks") or 2)
    h = hosts if hosts is not None else (1 if link_class == "shm" else n)
    shape = Shape(h, max(1, n // h))
    unit_a = Model(Link(1.0, 0.0), Link(1.0, 0.0), Link(1.0, 0.0))
    unit_b = Model(Link(0.0, 1.0), Link(0.0, 1.0), Link(0.0, 1.0))
    xs: list[tuple[float, float, float]] = []
    for r in rows:
        algo = str(r["algorithm"]).split()[0].split("+")[0]  # "ring ~1.01s" -> ring
        try:
            a = flat_time(r["op"], algo, int(r["size"]), shape, unit_a)
            b = flat_time(r["op"], algo, int(r["size"]), shape, unit_b)
        except ValueError:
            continue
        xs.append((a, b, float(r["out_of_place"]["time_us"]) * 1e-6))
    if not xs:
        raise ValueError("no row with an algorithm the model knows")
    return _nnls2(xs)


def _nnls2(xs: list[tuple[float, float, float]]) -> Link:
    """Least squares t = alpha a + beta b with alpha, beta >= 0, weighting each row by 1/t
    (relative error: small and large messages count alike)."""
    w = [(a / t, b / t, 1.0) for a, b, t in xs if t > 0]
    saa = sum(a * a for a, _, _ in w)
    sbb = sum(b * b for _, b, _ in w)
    sab = sum(a * b for a, b, _ in w)
    sat = sum(a * t for a, _, t in w)
    sbt = sum(b * t for _, b, t in w)
    det = saa * sbb - sab * sab
    if det > 0:
        alpha = (sat * sbb - sbt * sab) / det
        beta = (saa * sbt - sab * sat) / det
        if alpha >= 0 and beta >= 0:
            return Link(alpha, beta)
    alpha = sat / saa if saa else 0.0
    beta = sbt / sbb if sbb else 0.0
    # one of them alone: keep the better fit
    err_a = sum((t - alpha * a) ** 2 for a, _, t in w)
    err_b = sum((t - beta * b) ** 2 for _, b, t in w)
    return Link(max(alpha, 0.0), 0.0) if err_a <= err_b else Link(0.0, max(beta, 0.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plait.tuning.cost")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate", help="fit alpha/beta of a link class to plait bench --json")
    c.add_argument("json")
    c.add_argument("--class", dest="cls", default="shm",
                   choices=("shm", "switch", "cross_switch"))
    c.add_argument("--hosts", type=int, default=None)
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    link = calibrate(data, args.cls, hosts=args.hosts)
    print(f"[links.{args.cls}]")
    print(f'latency = "{link.alpha * 1e6:.2f}us"')
    print(f"bandwidth = {8 / link.beta:.4g}  # bit/s" if link.beta else "# bandwidth: no fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
