"""Property tests of the peer math: every algorithm's schedules, for world sizes 1-64,
executed together in one process by the simulator and compared with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.algorithms import (
    allgather_bruck,
    allgather_ring,
    allreduce_rd,
    allreduce_ring,
    alltoall_pairwise,
    barrier_dissemination,
    broadcast_chain,
    broadcast_tree,
    gather_linear,
    peers,
    reduce_scatter_ring,
    reduce_tree,
)
from plait.algorithms.schedule import Recv, Schedule, Send, Step
from plait.algorithms.simulate import Deadlock, simulate

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 32, 33, 64]


def add(acc: np.ndarray, other: np.ndarray) -> None:
    np.add(acc, other, out=acc)


def data(rank: int, count: int, salt: int = 0) -> np.ndarray:
    return (np.arange(count, dtype=np.int64) * 1009 + rank * 7919 + salt * 31) % 100003


def counts_for(n: int) -> list[int]:
    return [0, 1, 7, 3 * n + 2]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mod", [allreduce_ring, allreduce_rd], ids=["ring", "rd"])
def test_allreduce(n: int, mod) -> None:
    for count in counts_for(n):
        bufs = [data(r, count) for r in range(n)]
        want = sum(data(r, count) for r in range(n)) if count else np.zeros(0, np.int64)
        simulate([mod.schedule(r, n, count) for r in range(n)], bufs, bufs, add, in_place=True)
        for r in range(n):
            np.testing.assert_array_equal(bufs[r], want, err_msg=f"rank {r} count {count}")


@pytest.mark.parametrize("n", SIZES)
def test_broadcast(n: int) -> None:
    for count in counts_for(n):
        for root in {0, n - 1, n // 2}:
            for scheds in ([broadcast_tree.schedule(r, n, count, root) for r in range(n)],
                           [broadcast_chain.schedule(r, n, count, root, 5) for r in range(n)]):
                bufs = [data(r, count) for r in range(n)]
                simulate(scheds, bufs, bufs, None, in_place=True)
                for r in range(n):
                    np.testing.assert_array_equal(bufs[r], data(root, count))


@pytest.mark.parametrize("n", SIZES)
def test_reduce(n: int) -> None:
    for count in counts_for(n):
        for root in {0, n - 1, n // 2}:
            bufs = [data(r, count) for r in range(n)]
            simulate([reduce_tree.schedule(r, n, count, root) for r in range(n)], bufs, bufs,
                     add, in_place=True)
            for r in range(n):
                want = sum(data(k, count) for k in range(n)) if r == root else data(r, count)
                np.testing.assert_array_equal(bufs[r], want)


def uneven(n: int, base: int) -> tuple[int, ...]:
    return tuple((base * (r + 1) + r * r) % (base + 3) for r in range(n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algo", ["ring", "bruck"])
def test_allgatherv(n: int, algo: str) -> None:
    for counts in [(0,) * n, (1,) * n, (7,) * n, uneven(n, 5)]:
        ins = [data(r, counts[r]) for r in range(n)]
        outs = [np.zeros(sum(counts), np.int64) for _ in range(n)]
        mod = allgather_ring if algo == "ring" else allgather_bruck
        simulate([mod.schedule(r, n, counts) for r in range(n)], ins, outs)
        want = np.concatenate(ins)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], want)


@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter(n: int) -> None:
    for c in [0, 1, 7]:
        counts = (c,) * n
        ins = [data(r, c * n) for r in range(n)]
        keep = [x.copy() for x in ins]
        outs = [np.zeros(c, np.int64) for _ in range(n)]
        simulate([reduce_scatter_ring.schedule(r, n, counts) for r in range(n)], ins, outs, add)
        total = sum(keep)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], total[r * c:(r + 1) * c])
            np.testing.assert_array_equal(ins[r], keep[r])  # sendbuf untouched


@pytest.mark.parametrize("n", SIZES)
def test_alltoallv(n: int) -> None:
    sc = [tuple((r * 3 + j * 5) % 4 for j in range(n)) for r in range(n)]
    rc = [tuple(sc[i][j] for i in range(n)) for j in range(n)]
    ins = [data(r, sum(sc[r])) for r in range(n)]
    outs = [np.zeros(sum(rc[r]), np.int64) for r in range(n)]
    simulate([alltoall_pairwise.schedule(r, n, sc[r], rc[r]) for r in range(n)], ins, outs)
    for j in range(n):
        parts = []
        for i in range(n):
            off = sum(sc[i][:j])
            parts.append(ins[i][off:off + sc[i][j]])
        np.testing.assert_array_equal(outs[j], np.concatenate(parts))


@pytest.mark.parametrize("n", SIZES)
def test_alltoall_is_congestion_free(n: int) -> None:
    """Step k: every rank sends to r+k and receives from r-k (a shift permutation)."""
    scheds = [alltoall_pairwise.schedule(r, n, (2,) * n, (2,) * n) for r in range(n)]
    for k in range(1, n):
        dsts = [next(x.peer for x in scheds[r].steps[k].xfers if isinstance(x, Send))
                for r in range(n)]
        assert sorted(dsts) == list(range(n))
        assert all(d == (r + k) % n for r, d in enumerate(dsts))


@pytest.mark.parametrize("n", SIZES)
def test_gather_scatter(n: int) -> None:
    for c in [0, 1, 7]:
        for root in {0, n - 1}:
            ins = [data(r, c) for r in range(n)]
            outs = [np.zeros(c * n, np.int64) if r == root else None for r in range(n)]
            simulate([gather_linear.gather(r, n, c, root) for r in range(n)], ins, outs)
            np.testing.assert_array_equal(outs[root], np.concatenate(ins))
            src = data(99, c * n)
            ins2 = [src if r == root else None for r in range(n)]
            outs2 = [np.zeros(c, np.int64) for _ in range(n)]
            simulate([gather_linear.scatter(r, n, c, root) for r in range(n)], ins2, outs2)
            for r in range(n):
                np.testing.assert_array_equal(outs2[r], src[r * c:(r + 1) * c])


@pytest.mark.parametrize("n", SIZES)
def test_barrier_everyone_hears_from_everyone(n: int) -> None:
    scheds = [barrier_dissemination.schedule(r, n) for r in range(n)]
    heard = [{r} for r in range(n)]
    for k in range(max(len(s.steps) for s in scheds)):
        new = [set(h) for h in heard]
        for r in range(n):
            for x in scheds[r].steps[k].xfers:
                if isinstance(x, Recv):
                    new[r] |= heard[x.peer]
        heard = new
    assert all(h == set(range(n)) for h in heard)
    simulate(scheds, [np.zeros(0)] * n, [np.zeros(0)] * n)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(0, 63))
def test_binomial_tree_is_a_tree(n: int, v: int) -> None:
    v = v % n
    parent = peers.binomial_parent(v)
    if v == 0:
        assert parent is None
    else:
        assert parent is not None and 0 <= parent < v and v in peers.binomial_children(parent, n)
    for c in peers.binomial_children(v, n):
        assert peers.binomial_parent(c) == v


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64))
def test_recursive_doubling_ranks(n: int) -> None:
    p, rem = peers.rd_layout(n)
    assert p & (p - 1) == 0 and p <= n < 2 * p
    new = [peers.rd_newrank(r, rem) for r in range(n)]
    kept = [x for x in new if x is not None]
    assert sorted(kept) == list(range(p))
    for r, x in enumerate(new):
        if x is not None:
            assert peers.rd_oldrank(x, rem) == r


def test_simulator_detects_deadlock_and_overlap() -> None:
    lonely = [Schedule((Step(xfers=(Recv(1, 1, 0, 1),)),)), Schedule(())]
    with pytest.raises(Deadlock):
        simulate(lonely, [np.zeros(1), np.zeros(1)], [np.zeros(1), np.zeros(1)])
    racy = Schedule((Step(xfers=(Send(1, 1, 0, 2), Recv(1, 1, 1, 2))),))
    with pytest.raises(ValueError, match="overlaps"):
        simulate([racy, racy], [np.zeros(3)] * 2, [np.zeros(3), np.zeros(3)])
