"""Every collective algorithm, declared once: its name, the operations it serves, its kind,
when it can run, how to plan it and its closed-form traffic.

The selector (names, feasibility, ``PLAIT_ALGO`` validation), the cost model (plans and
the kind of each algorithm), the communicator's dispatch and the algorithm table in
docs/DESIGN.md (``table_markdown``) all read this module.

Kinds:

- ``SCHEDULE``: point-to-point schedules (``plan``) that the executor runs; ``counts``
  gives their traffic in closed form (tests/test_registry.py checks it against the plans).
- ``HOST``: runs whole on a host collective: today the direct shared-memory algorithms
  of the compiled engine (transport/csrc/engine.c), which exchange through slots and
  have no schedule.
- ``COMPOSITE``: phases on sub-communicators (algorithms/hier.py), each choosing its own
  flat algorithm.

The entries are declared here, not in the algorithm modules: this module imports the
modules (their ``plan`` and ``counts``), never the other way round, so there is no import
cycle and importing this module registers everything. The HOST and COMPOSITE entries need
nothing from their modules, so hier.py is not imported at all (it works with
communicators, far above this layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from . import (
    allgather_bruck,
    allgather_ring,
    allreduce_rd,
    allreduce_ring,
    alltoall_pairwise,
    barrier_dissemination,
    broadcast_chain,
    broadcast_tree,
    gather_linear,
    reduce_scatter_ring,
    reduce_tree,
)
from .schedule import Args, Counts, Schedule, split_even

__all__ = ["COMPOSITE", "HOST", "OPS", "SCHEDULE", "VARIANTS", "Algorithm", "Args", "Counts",
           "Fit", "algorithms", "get", "key", "model_args", "names", "register",
           "table_markdown"]

SCHEDULE, HOST, COMPOSITE = "schedule", "host", "composite"
KINDS = (SCHEDULE, HOST, COMPOSITE)

OPS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
       "gather", "scatter", "barrier")
"""The selection keys: ``PLAIT_ALGO`` names these; a variant selects under its base."""

VARIANTS = {"allgatherv": "allgather", "alltoallv": "alltoall",
            "reduce_scatterv": "reduce_scatter"}
"""Operations that select under another's key (their algorithms may differ in
feasibility: ``Algorithm.feasible`` gets the real operation)."""


@dataclass(frozen=True)
class Fit:
    """What feasibility may depend on; identical on every rank of a communicator."""

    size: int
    all_local: bool  # every rank on one host, shared memory usable (size > 1 not implied)
    hosts: int = 1
    local_size: int = 0  # ranks per host when equal on every host and shm possible, else 0
    slot_size: int = 0  # bytes per rank of the direct algorithms' slot
    composite: bool = True  # False inside a composite's phases: they must not recurse


@dataclass(frozen=True)
class Algorithm:
    """One algorithm. ``feasible(op, slot_bytes, fit)`` gets the real operation (e.g.
    "alltoallv") and the largest per-rank slot content in bytes. ``plan(op, args)``: one
    rank's schedule; ``counts(op, n, nbytes)``: the traffic of ``model_args`` plans (both
    SCHEDULE only)."""

    name: str
    ops: tuple[str, ...]
    kind: str
    summary: str
    feasible: Callable[[str, int, Fit], bool]
    plan: Callable[[str, Args], Schedule] | None = None
    counts: Callable[[str, int, int], Counts] | None = None


_ALGORITHMS: list[Algorithm] = []
_BY_KEY: dict[tuple[str, str], Algorithm] = {}


def key(op: str) -> str:
    """The selection key of ``op``: "allgatherv" -> "allgather", "alltoallv" ->
    "alltoall", "reduce_scatterv" -> "reduce_scatter"; others are their own."""
    k = VARIANTS.get(op, op)
    if k not in OPS:
        raise ValueError(f"no collective operation {op!r} (one of "
                         f"{', '.join([*OPS, *VARIANTS])})")
    return k


def register(alg: Algorithm) -> Algorithm:
    """Add ``alg``; names are unique per operation. Returns ``alg``."""
    if alg.kind not in KINDS:
        raise ValueError(f"algorithm {alg.name!r}: kind {alg.kind!r} is not one of "
                         f"{', '.join(KINDS)}")
    if (alg.kind == SCHEDULE) != (alg.plan is not None and alg.counts is not None):
        raise ValueError(f"algorithm {alg.name!r}: a schedule algorithm, and only one, has "
                         "plan and counts")
    for op in alg.ops:
        if op not in OPS:
            raise ValueError(f"algorithm {alg.name!r}: {op!r} is not a selection key "
                             f"({', '.join(OPS)})")
        if (op, alg.name) in _BY_KEY:
            raise ValueError(f"{op} already has an algorithm {alg.name!r}")
    for op in alg.ops:
        _BY_KEY[(op, alg.name)] = alg
    _ALGORITHMS.append(alg)
    return alg


def get(op: str, name: str) -> Algorithm:
    """The algorithm ``name`` of ``op`` (a variant looks under its key); ValueError naming
    the operation and its algorithms if there is none."""
    alg = _BY_KEY.get((key(op), name))
    if alg is None:
        raise ValueError(f"{op} has no algorithm {name!r} (choose from "
                         f"{', '.join(names(op))})")
    return alg


def names(op: str) -> tuple[str, ...]:
    """The algorithms of ``op`` (a variant: of its key), in declaration order."""
    k = key(op)
    return tuple(a.name for a in _ALGORITHMS if k in a.ops)


def algorithms() -> tuple[Algorithm, ...]:
    """Every registered algorithm, in declaration order."""
    return tuple(_ALGORITHMS)


def model_args(op: str, rank: int, n: int, nbytes: int) -> Args:
    """The Args the cost model plans with (and ``Algorithm.counts`` describes): elements
    of one byte, root 0, identity order, ``nbytes`` as the selector measures the operation
    (the buffer; allgather(v): the gathered total; reduce_scatter(v) and alltoall(v): one
    rank's input; gather/scatter: the root's whole buffer), blocks split evenly."""
    k = key(op)
    if k in ("allreduce", "broadcast", "reduce"):
        return Args(rank, n, (nbytes,))
    if k in ("allgather", "reduce_scatter"):
        return Args(rank, n, tuple(split_even(nbytes, n)))
    if k == "alltoall":
        # an alltoallv whose receives match what every rank sends to this one
        send = tuple(split_even(nbytes, n))
        return Args(rank, n, send, (send[rank],) * n)
    if k in ("gather", "scatter"):
        return Args(rank, n, (nbytes // n,))
    return Args(rank, n)


def table_markdown() -> str:
    """The algorithm table of docs/DESIGN.md: operations, name, kind, summary."""
    rows = ["| operation | algorithm | kind | summary |", "|---|---|---|---|"]
    for a in _ALGORITHMS:
        rows.append(f"| {', '.join(a.ops)} | `{a.name}` | {a.kind} | {a.summary} |")
    return "\n".join(rows) + "\n"


# -- feasibility ---------------------------------------------------------------------------


def _always(op: str, slot_bytes: int, fit: Fit) -> bool:
    # point-to-point schedules run on any communicator, any size, any placement
    return True


def _direct(op: str, slot_bytes: int, fit: Fit) -> bool:
    # Every rank on one host; data larger than a slot moves in pieces. alltoallv's blocks
    # differ per pair and reduce_scatterv's per rank: the slot exchange has no variant
    # for them.
    return (op not in ("alltoallv", "reduce_scatterv") and fit.all_local and fit.size > 1
            and fit.slot_size > 0)


def _slices(op: str, slot_bytes: int, fit: Fit) -> bool:
    return op == "allreduce" and fit.all_local and fit.size > 1 and fit.slot_size > 0


def _hier(op: str, slot_bytes: int, fit: Fit) -> bool:
    # two levels to be hierarchical about, and equal hosts so that local rank i of every
    # host forms rail i; not inside its own phases, and no uneven reduce-scatter blocks
    return (op != "reduce_scatterv" and fit.composite and fit.hosts >= 2
            and fit.local_size >= 2)


# -- the algorithms, in the order selection lists them ------------------------------------


class _ScheduleModule(Protocol):
    """What a SCHEDULE algorithm's module provides (next to its ``schedule``)."""

    def plan(self, op: str, a: Args) -> Schedule: ...
    def counts(self, op: str, n: int, nbytes: int) -> Counts: ...


def _schedule(name: str, ops: tuple[str, ...], summary: str, mod: _ScheduleModule
              ) -> Algorithm:
    return register(Algorithm(name, ops, SCHEDULE, summary, _always, mod.plan, mod.counts))


register(Algorithm(
    "direct", OPS, HOST,
    "shared-memory slots: one write, one wait, direct reads, in pieces of a slot; every "
    "rank on one host (not alltoallv, reduce_scatterv)", _direct))
register(Algorithm(
    "slices", ("allreduce",), HOST,
    "shared-memory slots, per piece: each rank reduces 1/n of it in place, then every "
    "rank copies all n slices; every rank on one host", _slices))
register(Algorithm(
    "inplace", tuple(op for op in OPS if op != "barrier"), HOST,
    "what each rank needs read straight from the peers' buffers (process_vm_readv: one "
    "copy; allreduce by slices), through the slots where some pair cannot; every rank on "
    "one host (not alltoallv, reduce_scatterv)", _direct))
_schedule("rd", ("allreduce",), "recursive doubling, any size; small messages", allreduce_rd)
_schedule("ring", ("allreduce",), "reduce-scatter ring + allgather ring, in topology order",
          allreduce_ring)
_schedule("tree", ("broadcast",), "binomial tree; small messages", broadcast_tree)
_schedule("chain", ("broadcast",), "pipelined chain of pieces of at least 1 MiB",
          broadcast_chain)
_schedule("tree", ("reduce",), "binomial tree", reduce_tree)
_schedule("bruck", ("allgather",), "Bruck: ceil(log2 n) steps; small messages",
          allgather_bruck)
_schedule("ring", ("allgather",), "ring", allgather_ring)
_schedule("ring", ("reduce_scatter",), "ring (also uneven blocks: reduce_scatterv)",
          reduce_scatter_ring)
_schedule("pairwise", ("alltoall",), "pairwise exchange, step k: to r+k, from r-k",
          alltoall_pairwise)
_schedule("linear", ("gather", "scatter"), "the root exchanges with every rank in one step",
          gather_linear)
_schedule("dissemination", ("barrier",), "dissemination: ceil(log2 n) rounds",
          barrier_dissemination)
register(Algorithm(
    "hier", ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"), COMPOSITE,
    "host-local and rail sub-communicators (rail-aligned); two or more hosts of equal "
    "ranks, two or more each", _hier))
