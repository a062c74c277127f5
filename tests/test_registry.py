"""The algorithm registry (algorithms/registry.py): every schedule algorithm's closed-form
traffic against its plans run by the simulator, the selector's names, PLAIT_ALGO
validation and the docs table all read from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plait.algorithms import allreduce_ring, broadcast_chain, registry
from plait.algorithms.schedule import IN, OUT, Copy, Recv, Reduce, Schedule, Send
from plait.algorithms.simulate import simulate
from plait.tuning import cost, selector

NBYTES = (0, 1, 7, 1000, 3 << 20)
WORLDS = range(1, 10)

EXPECTED = {
    "allreduce": ("direct", "slices", "inplace", "rd", "ring", "hier"),
    "broadcast": ("direct", "inplace", "tree", "chain", "hier"),
    "reduce": ("direct", "inplace", "tree"),
    "allgather": ("direct", "inplace", "bruck", "ring", "hier"),
    "reduce_scatter": ("direct", "inplace", "ring", "hier"),
    "alltoall": ("direct", "inplace", "pairwise", "hier"),
    "gather": ("direct", "inplace", "linear"),
    "scatter": ("direct", "inplace", "linear"),
    "barrier": ("direct", "dissemination"),
}


def _served(alg: registry.Algorithm) -> list[str]:
    """The operations ``alg`` serves, variants (allgatherv, ...) included: schedules run
    anywhere, so every one of them is feasible."""
    return list(alg.ops) + [v for v, k in registry.VARIANTS.items() if k in alg.ops]


SCHEDULED = [pytest.param(alg, op, id=f"{op}:{alg.name}") for alg in registry.algorithms()
             if alg.kind == registry.SCHEDULE for op in _served(alg)]


def _buffers(sched: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """IN and OUT large enough for everything ``sched`` touches (bytes: traffic only)."""
    need = {IN: 0, OUT: 0}
    for st in sched.steps:
        for x in st.xfers:
            if x.buf in need:
                need[x.buf] = max(need[x.buf], x.off + x.count)
        for c in st.local:
            assert isinstance(c, Copy | Reduce)
            for buf, off in ((c.src, c.src_off), (c.dst, c.dst_off)):
                if buf in need:
                    need[buf] = max(need[buf], off + c.count)
    return np.zeros(need[IN], np.uint8), np.zeros(need[OUT], np.uint8)


def _measure(scheds: list[Schedule]) -> registry.Counts:
    bufs = [_buffers(s) for s in scheds]
    flows = simulate(scheds, [b[0] for b in bufs], [b[1] for b in bufs],
                     lambda d, s: np.add(d, s, out=d))
    steps = max((sum(1 for st in s.steps if st.xfers) for s in scheds), default=0)
    sends = sum(isinstance(x, Send) for s in scheds for st in s.steps for x in st.xfers)
    assert sends == len(flows)  # every Send travelled (the simulator checks the Recvs)
    return registry.Counts(steps, len(flows), sum(f.count for f in flows))


@pytest.mark.parametrize(("alg", "op"), SCHEDULED)
def test_closed_form_counts_match_the_plans(alg: registry.Algorithm, op: str) -> None:
    assert alg.plan is not None and alg.counts is not None
    for n in WORLDS:
        for nbytes in NBYTES:
            scheds = [alg.plan(op, registry.model_args(op, r, n, nbytes)) for r in range(n)]
            got = _measure(scheds)
            assert alg.counts(op, n, nbytes) == got, (op, alg.name, n, nbytes)
            # the cost model plans exactly these
            assert cost.schedules(op, alg.name, n, nbytes) == scheds


def test_ring_allreduce_follows_the_order() -> None:
    alg = registry.get("allreduce", "ring")
    assert alg.plan is not None
    order = (0, 3, 1, 4, 2, 5)
    n = len(order)
    scheds = [alg.plan("allreduce", registry.Args(r, n, (12,), order=order)) for r in range(n)]
    assert scheds == [allreduce_ring.in_order(r, n, 12, order) for r in range(n)]
    for p, r in enumerate(order):  # position p sends to position p+1
        first = scheds[r].steps[0].xfers
        assert [x.peer for x in first if isinstance(x, Send)] == [order[(p + 1) % n]]
        assert [x.peer for x in first if isinstance(x, Recv)] == [order[(p - 1) % n]]
    identity = alg.plan("allreduce", registry.Args(1, n, (12,), order=tuple(range(n))))
    assert identity == allreduce_ring.schedule(1, n, 12)
    assert _measure(scheds) == alg.counts("allreduce", n, 12)  # type: ignore[misc]


def test_chain_pieces_one_formula_in_bytes() -> None:
    """Executor (elements of 4 bytes) and cost model (bytes) cut the same pieces."""
    alg = registry.get("broadcast", "chain")
    assert alg.plan is not None
    count = 5 << 20  # 20 MiB of float32: pieces of 1 MiB
    for n, k in ((2, 1), (3, 20), (5, 20)):
        assert broadcast_chain.pieces(n, 4 * count) == k
        root = alg.plan("broadcast", registry.Args(0, n, (count,), itemsize=4))
        assert sum(isinstance(x, Send) for st in root.steps for x in st.xfers) == k
        model = cost.schedules("broadcast", "chain", n, 4 * count)
        assert model is not None
        assert sum(isinstance(x, Send) for st in model[0].steps for x in st.xfers) == k
    assert broadcast_chain.pieces(3, 200 << 20) == 64  # at most 64 pieces


def test_names_and_feasibility() -> None:
    assert {op: registry.names(op) for op in registry.OPS} == EXPECTED
    assert selector.ALGORITHMS == EXPECTED
    assert registry.names("allgatherv") == EXPECTED["allgather"]
    assert registry.key("reduce_scatterv") == "reduce_scatter"
    with pytest.raises(ValueError, match=r"alltoallv has no algorithm 'ring' \(choose from "
                                         r"direct, inplace, pairwise, hier\)"):
        registry.get("alltoallv", "ring")
    with pytest.raises(ValueError, match="no collective operation 'allfoo'"):
        registry.get("allfoo", "ring")
    one_host = registry.Fit(4, True, slot_size=1024)
    direct = registry.get("allreduce", "direct")
    assert direct.kind == registry.HOST and direct.plan is None
    assert direct.feasible("allreduce", 1024, one_host)
    assert direct.feasible("allreduce", 1 << 30, one_host)  # in pieces of a slot
    slices = registry.get("allreduce", "slices")
    assert slices.kind == registry.HOST and slices.feasible("allreduce", 1 << 20, one_host)
    assert not slices.feasible("allreduce", 8, registry.Fit(4, False, 2, 2, 1024))
    assert not direct.feasible("allreduce", 8, registry.Fit(1, True, slot_size=1024))
    assert not direct.feasible("allreduce", 8, registry.Fit(4, False, 2, 2, 1024))
    assert direct.feasible("alltoall", 8, one_host)
    assert not direct.feasible("alltoallv", 8, one_host)
    assert not direct.feasible("reduce_scatterv", 8, one_host)
    hier = registry.get("allreduce", "hier")
    two_hosts = registry.Fit(4, False, hosts=2, local_size=2)
    assert hier.kind == registry.COMPOSITE
    assert hier.feasible("allreduce", 1 << 30, two_hosts)
    assert not hier.feasible("allreduce", 0, registry.Fit(4, False, hosts=2, local_size=0))
    assert not hier.feasible("allreduce", 0, registry.Fit(4, False, hosts=4, local_size=1))
    assert not hier.feasible("allreduce", 0, registry.Fit(4, True, hosts=1, local_size=4))
    assert not hier.feasible("allreduce", 0,
                             registry.Fit(4, False, hosts=2, local_size=2, composite=False))
    assert not hier.feasible("reduce_scatterv", 0, two_hosts)
    assert registry.get("reduce_scatterv", "ring").feasible("reduce_scatterv", 0, two_hosts)


def test_reduce_scatterv_selects_ring() -> None:
    sit = selector.Situation(4, False, True, 1 << 16, hosts=2, local_size=2)
    assert selector.choose("reduce_scatterv", 1 << 20, sit).algo == "ring"
    local = selector.Situation(4, True, False, 1 << 16)
    assert selector.choose("reduce_scatter", 64, local).algo == "direct"
    assert selector.choose("reduce_scatterv", 64, local).algo == "ring"
    assert sit.fit == registry.Fit(4, False, 2, 2, 1 << 16, True)


def test_every_default_names_a_registered_algorithm() -> None:
    table = selector.parse(selector.DEFAULTS)
    assert set(table) == set(registry.OPS)
    for op, rules in table.items():
        for r in rules:
            assert registry.get(op, r.algo).name == r.algo


def test_unknown_algorithm_rejected_with_the_registry_list() -> None:
    for op in registry.OPS:
        want = (f"PLAIT_ALGO: {op} has no algorithm 'nope' (choose from "
                f"{', '.join(registry.names(op))})")
        with pytest.raises(ValueError) as exc:
            selector.parse(f"{op}:nope")
        assert str(exc.value) == want
    sit = selector.Situation(2, True, False, 1 << 16)
    with pytest.raises(ValueError, match=r"choose from direct, slices, inplace, rd, ring, hier"):
        selector.choose("allreduce", 8, sit, "allreduce:0-1K:ring,nope")
    with pytest.raises(ValueError) as exc:
        selector.parse("allfoo:ring")
    assert str(exc.value) == ("PLAIT_ALGO: 'allfoo:ring': expected OP:rules with OP one of "
                              f"{', '.join(registry.OPS)}")


def test_table_lists_every_algorithm_and_is_in_the_docs() -> None:
    table = registry.table_markdown()
    rows = table.splitlines()[2:]
    assert len(rows) == len(registry.algorithms())
    for alg, row in zip(registry.algorithms(), rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [", ".join(alg.ops), f"`{alg.name}`", alg.kind, alg.summary]
    listed = {(op, c[1].strip("`")) for c in
              ([x.strip() for x in row.strip("|").split("|")] for row in rows)
              for op in c[0].split(", ")}
    assert listed == {(op, name) for op, names in EXPECTED.items() for name in names}
    design = Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md"
    assert table in design.read_text(), "docs/DESIGN.md: paste registry.table_markdown()"
