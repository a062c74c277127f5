"""Choosing an algorithm per operation: defaults and user overrides in one grammar.

Grammar (``PLAIT_ALGO`` and the built-in defaults alike)::

    spec    := opspec (";" opspec)*
    opspec  := OP ":" rule ("," rule)*
    rule    := [LO "-" [HI] ":"] ALGO      sizes in bytes, K/M/G suffixes; HI exclusive

e.g. ``allreduce:0-64K:direct,64K-:ring;broadcast:chain``. A rule applies when the
message size is in its range and the algorithm can run here (``direct`` needs every rank
on one host and the data in a slot); the first applicable override wins, then the default
rule. If overrides name an operation but none of their algorithms can run, the error says
so. Every decision is logged at DEBUG level on logger ``plait.select``.

``hier`` (hierarchical, rail-aligned: algorithms/hier.py) can run when the communicator
spans two or more hosts with the same number (two or more) of ranks each. In the defaults
it is a candidate, not a verdict: where it can run, the cost model (tuning/cost.py)
predicts it and the flat algorithm the remaining default rules pick, and the faster one
wins; the log line gives both estimates. A ``hier`` override is taken as it stands.
``choose`` returns the whole decision (algorithm, source, estimates) for tools such as
``plait bench``.

The operations, their algorithms and when each can run come from the algorithm registry
(``plait.algorithms.registry``; the table is in docs/DESIGN.md). A variant (allgatherv,
alltoallv, reduce_scatterv) selects under its operation's rules, with its own feasibility.
Inside a composite algorithm's phases (``Situation.composite`` False) rules naming a
composite algorithm are dropped, overrides included: a ``hier`` override applies to the
communicator it was given to, not to hier's own sub-communicators.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..algorithms import registry
from ..config import parse_size
from . import cost

log = logging.getLogger("plait.select")

ALGORITHMS: dict[str, tuple[str, ...]] = {op: registry.names(op) for op in registry.OPS}
"""Operation (selection key) -> its algorithms' names, from the registry."""

# The defaults, in the same grammar: every rank on one host, the compiled engine —
# "direct" through the slots for small data, "inplace" (single copies from the peers'
# buffers) from the sizes where it measured faster (docs/PERFORMANCE.md); otherwise hier
# where it can run, then the schedules.
DEFAULTS = (
    "allreduce:0-2M:direct,inplace,hier,0-64K:rd,ring;"
    "broadcast:0-16K:direct,inplace,hier,0-256K:tree,chain;"
    "reduce:0-16K:direct,inplace,tree;"
    "allgather:0-16K:direct,inplace,hier,0-64K:bruck,ring;"
    "reduce_scatter:0-16K:direct,inplace,hier,ring;"
    "alltoall:0-16K:direct,inplace,hier,pairwise;"
    "gather:0-16K:direct,inplace,linear;"
    "scatter:0-16K:direct,inplace,linear;"
    "barrier:direct,dissemination"
)


@dataclass(frozen=True)
class Rule:
    lo: int
    hi: int | None
    algo: str

    def covers(self, nbytes: int) -> bool:
        return self.lo <= nbytes and (self.hi is None or nbytes < self.hi)


@dataclass(frozen=True)
class Situation:
    """What selection may depend on; identical on every rank of a communicator."""

    size: int
    all_local: bool
    any_tcp: bool
    slot_size: int
    hosts: int = 1
    local_size: int = 0  # ranks per host when equal on every host, else 0
    rails: int = 1
    switches: int = 1
    model: cost.Model = field(default_factory=cost.Model)
    composite: bool = True  # False on the sub-communicators of a composite's phases

    @property
    def shape(self) -> cost.Shape:
        local = self.local_size or max(1, self.size // max(1, self.hosts))
        return cost.Shape(self.hosts, local, self.rails, self.switches)

    @property
    def fit(self) -> registry.Fit:
        """What the registry's feasibility rules read."""
        return registry.Fit(self.size, self.all_local, self.hosts, self.local_size,
                            self.slot_size, self.composite)


def situation(size: int, all_local: bool, any_tcp: bool, slot_size: int, topo: Any,
              shm_possible: bool = True, composite: bool = True) -> Situation:
    """A communicator's Situation, from its topology (identical on every rank)."""
    if topo is None:
        return Situation(size, all_local, any_tcp, slot_size, composite=composite)
    return Situation(size, all_local, any_tcp, slot_size, hosts=len(topo.hosts),
                     local_size=topo.local_size() if shm_possible else 0,
                     rails=max(1, topo.rails()), switches=max(1, len(topo.switches())),
                     model=cost.Model.from_topology(topo), composite=composite)


def parse(spec: str) -> dict[str, tuple[Rule, ...]]:
    """Parse the grammar above; raise ValueError naming the bad part."""
    table: dict[str, list[Rule]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        op, sep, rules = part.partition(":")
        op = op.strip()
        if not sep or op not in registry.OPS:
            raise ValueError(f"PLAIT_ALGO: {part!r}: expected OP:rules with OP one of "
                             f"{', '.join(registry.OPS)}")
        for r in filter(None, (x.strip() for x in rules.split(","))):
            fields = r.split(":")
            if len(fields) == 1:
                lo, hi, algo = 0, None, fields[0]
            elif len(fields) == 2:
                rng, algo = fields
                a, dash, b = rng.partition("-")
                if not dash:
                    raise ValueError(f"PLAIT_ALGO: {r!r}: a range is LO-HI or LO-")
                lo = parse_size(a) if a else 0
                hi = parse_size(b) if b else None
            else:
                raise ValueError(f"PLAIT_ALGO: {r!r}: expected [LO-[HI]:]ALGO")
            algo = algo.strip()
            if algo not in registry.names(op):
                raise ValueError(f"PLAIT_ALGO: {op} has no algorithm {algo!r} (choose from "
                                 f"{', '.join(registry.names(op))})")
            table.setdefault(op, []).append(Rule(lo, hi, algo))
    return {k: tuple(v) for k, v in table.items()}


_DEFAULT_TABLE = parse(DEFAULTS)


def feasible(op: str, algo: str, slot_bytes: int, sit: Situation) -> bool:
    """Whether ``algo`` can run ``op`` (variants included) here, with at most
    ``slot_bytes`` per rank in a slot."""
    return registry.get(op, algo).feasible(op, slot_bytes, sit.fit)


def _composite(op: str, algo: str) -> bool:
    return registry.get(op, algo).kind == registry.COMPOSITE


@dataclass(frozen=True)
class Decision:
    algo: str
    source: str  # "PLAIT_ALGO" or "default"
    estimate: float | None  # predicted seconds, where the model was asked
    estimates: tuple[tuple[str, float], ...] = ()  # the candidates the model compared

    def describe(self) -> str:
        if not self.estimates:
            return f"{self.algo} ({self.source})"
        alts = ", ".join(f"{a} {fmt_seconds(t)}" for a, t in self.estimates)
        return f"{self.algo} ({self.source}; model: {alts})"


def fmt_seconds(t: float) -> str:
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def _slot_bytes(op: str, nbytes: int, n: int) -> int:
    return nbytes // max(1, n) if op in ("allgather", "allgatherv", "gather") else nbytes


def estimate(op: str, algo: str, nbytes: int, sit: Situation) -> float:
    """The model's prediction (seconds) for ``algo`` running ``op`` of ``nbytes`` here."""
    if _composite(op, algo):
        def phase(o: str, nb: int, sh: cost.Shape) -> str:
            sub = Situation(sh.size, sh.hosts == 1, sh.hosts > 1, sit.slot_size, sh.hosts,
                            sh.local, sh.rails, sh.switches, sit.model, composite=False)
            return choose(o, nb, sub, slot_bytes=_slot_bytes(o, nb, sh.size)).algo

        return cost.hier_time(op, nbytes, sit.shape, sit.model, phase)
    return cost.flat_time(op, algo, nbytes, sit.shape, sit.model)


def select(op: str, nbytes: int, slot_bytes: int, sit: Situation, overrides: str = "") -> str:
    """The algorithm for ``op`` on a message of ``nbytes`` (its size as the rules read it)
    whose largest per-rank slot content is ``slot_bytes``."""
    return choose(op, nbytes, sit, overrides, slot_bytes).algo


class Chooser:
    """One communicator's decisions, cached per (operation, size, slot content): the
    algorithm from the registry (its situation and overrides never change)."""

    def __init__(self, sit: Situation, overrides: str = "") -> None:
        self.sit = sit
        self.overrides = overrides
        self.cache: dict[tuple[str, int, int], registry.Algorithm] = {}

    def __call__(self, op: str, nbytes: int, slot_bytes: int) -> registry.Algorithm:
        key = (op, nbytes, slot_bytes)
        alg = self.cache.get(key)
        if alg is None:
            alg = registry.get(op, select(op, nbytes, slot_bytes, self.sit, self.overrides))
            if len(self.cache) > 4096:
                self.cache.clear()
            self.cache[key] = alg
        return alg


@lru_cache(maxsize=4096)
def choose(op: str, nbytes: int, sit: Situation, overrides: str = "",
           slot_bytes: int | None = None) -> Decision:
    """The whole decision for ``op`` of ``nbytes``: user overrides first (the first that
    can run wins), then the defaults, where a feasible ``hier`` rule competes on predicted
    time with the flat algorithm the following rules pick."""
    if slot_bytes is None:
        slot_bytes = _slot_bytes(op, nbytes, sit.size)
    key = registry.key(op)
    user = parse(overrides).get(key, ()) if overrides else ()
    if not sit.composite:
        # a composite's phases: what names a composite is not meant for them (had only such
        # rules named this operation, the defaults apply, as if no override named it)
        user = tuple(r for r in user if not _composite(op, r.algo))
    for rules, source in ((user, "PLAIT_ALGO"), (_DEFAULT_TABLE[key], "default")):
        candidates = [r.algo for r in rules if r.covers(nbytes)
                      and feasible(op, r.algo, slot_bytes, sit)]
        if candidates:
            algo = candidates[0]
            d = Decision(algo, source, None)
            if source == "default" and _composite(op, algo) and len(candidates) > 1:
                flat = candidates[1]
                est: tuple[tuple[str, float], ...]
                try:
                    est = ((algo, estimate(op, algo, nbytes, sit)),
                           (flat, estimate(op, flat, nbytes, sit)))
                except ValueError:  # no model for the flat one: keep the table's order
                    est = ()
                if est:
                    best = min(est, key=lambda e: e[1])
                    d = Decision(best[0], source, best[1], est)
            log.debug("%s %d B (size %d) -> %s (%s)", op, nbytes, sit.size, d.algo,
                      d.describe().partition("(")[2].rstrip(")"))
            return d
        if rules and source == "PLAIT_ALGO" and any(r.covers(nbytes) for r in rules):
            raise ValueError(
                f"PLAIT_ALGO={overrides!r} selects no algorithm that can run {op} of {nbytes} "
                f"bytes here (direct, slices and inplace need every rank on one host; hier "
                f"needs two or more hosts with the same number, two or more, of ranks each)")
    raise AssertionError(f"no default algorithm for {op}")
