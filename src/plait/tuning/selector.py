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

Algorithms (OP: names):
  allreduce: direct, rd (recursive doubling), ring
  broadcast: direct, tree (binomial), chain (pipelined)
  reduce: direct, tree
  allgather (also allgatherv): direct, bruck, ring
  reduce_scatter: direct, ring
  alltoall (also alltoallv; direct only for alltoall): direct, pairwise
  gather, scatter: direct, linear
  barrier: direct, dissemination
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from ..config import parse_size

log = logging.getLogger("plait.select")

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("direct", "rd", "ring"),
    "broadcast": ("direct", "tree", "chain"),
    "reduce": ("direct", "tree"),
    "allgather": ("direct", "bruck", "ring"),
    "reduce_scatter": ("direct", "ring"),
    "alltoall": ("direct", "pairwise"),
    "gather": ("direct", "linear"),
    "scatter": ("direct", "linear"),
    "barrier": ("direct", "dissemination"),
}

# The defaults, in the same grammar. "direct" is first wherever it applies.
DEFAULTS = (
    "allreduce:direct,0-64K:rd,ring;"
    "broadcast:direct,0-256K:tree,chain;"
    "reduce:direct,tree;"
    "allgather:direct,0-64K:bruck,ring;"
    "reduce_scatter:direct,ring;"
    "alltoall:direct,pairwise;"
    "gather:direct,linear;"
    "scatter:direct,linear;"
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


def parse(spec: str) -> dict[str, tuple[Rule, ...]]:
    """Parse the grammar above; raise ValueError naming the bad part."""
    table: dict[str, list[Rule]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        op, sep, rules = part.partition(":")
        op = op.strip()
        if not sep or op not in ALGORITHMS:
            raise ValueError(f"PLAIT_ALGO: {part!r}: expected OP:rules with OP one of "
                             f"{', '.join(ALGORITHMS)}")
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
            if algo not in ALGORITHMS[op]:
                raise ValueError(f"PLAIT_ALGO: {op} has no algorithm {algo!r} (choose from "
                                 f"{', '.join(ALGORITHMS[op])})")
            table.setdefault(op, []).append(Rule(lo, hi, algo))
    return {k: tuple(v) for k, v in table.items()}


_DEFAULT_TABLE = parse(DEFAULTS)


def feasible(algo: str, nbytes_per_rank: int, sit: Situation) -> bool:
    if algo == "direct":
        return sit.all_local and sit.size > 1 and nbytes_per_rank <= sit.slot_size
    return True


@lru_cache(maxsize=4096)
def select(op: str, nbytes: int, slot_bytes: int, sit: Situation, overrides: str = "") -> str:
    """The algorithm for ``op`` on a message of ``nbytes`` (its size as the rules read it)
    whose largest per-rank slot content is ``slot_bytes``."""
    key = "allgather" if op == "allgatherv" else "alltoall" if op == "alltoallv" else op
    user = parse(overrides).get(key, ()) if overrides else ()
    for rules, source in ((user, "PLAIT_ALGO"), (_DEFAULT_TABLE[key], "default")):
        for rule in rules:
            if not rule.covers(nbytes):
                continue
            if rule.algo == "direct" and op == "alltoallv":
                continue
            if feasible(rule.algo, slot_bytes, sit):
                log.debug("%s %d B (size %d) -> %s (%s)", op, nbytes, sit.size, rule.algo, source)
                return rule.algo
        if rules and source == "PLAIT_ALGO" and any(r.covers(nbytes) for r in rules):
            raise ValueError(
                f"PLAIT_ALGO={overrides!r} selects no algorithm that can run {op} of {nbytes} "
                f"bytes here (direct needs every rank on one host and at most "
                f"{sit.slot_size} bytes per rank)")
    raise AssertionError(f"no default algorithm for {op}")
