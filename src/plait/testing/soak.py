"""The soak test's rank-side case: many mixed collectives, each verified, memory watched.

``case_soak(comm, ops, seed)`` runs ``ops`` collectives chosen at random (the same
sequence on every rank: one seeded generator) with random sizes, roots, dtypes and reduce
ops, checks every result against :mod:`plait.testing.reference`, and samples this rank's
resident memory. Used by ``tests/test_soak.py`` (slow tier) and ``benchmarks/soak.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from . import reference as ref
from .data import assert_equal, empty, make, values

KINDS = ("allreduce", "broadcast", "reduce", "allgather", "allgatherv", "gather", "scatter",
         "reduce_scatter", "alltoall", "alltoallv", "barrier")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_op(comm: Any, i: int, rng: np.random.Generator) -> str:
    """Run and verify collective ``i``; returns its kind."""
    n, me = comm.size, comm.rank
    kind = KINDS[int(rng.integers(len(KINDS)))]
    # mostly small, sometimes larger than any slot, chunk or ring
    count = int(rng.integers(0, 64)) if rng.random() < 0.6 else int(rng.integers(64, 40_000))
    dtype = ("float32", "int32", "int64", "float64")[int(rng.integers(4))]
    op = ("sum", "max", "min")[int(rng.integers(3))]
    root = int(rng.integers(n))
    seed = i
    mine = lambda k, o=None: make(dtype, k, me, op=o, seed=seed)  # noqa: E731
    theirs = lambda k, o=None: [values(dtype, k, r, op=o, seed=seed)  # noqa: E731
                                for r in range(n)]
    what = f"soak op {i}: {kind} of {count} {dtype}"
    if kind == "allreduce":
        b = mine(count, op)
        comm.allreduce(b, op)
        assert_equal(b, ref.allreduce(theirs(count, op), op)[me], what)
    elif kind == "broadcast":
        b = mine(count)
        comm.broadcast(b, root)
        assert_equal(b, values(dtype, count, root, seed=seed), what)
    elif kind == "reduce":
        b = mine(count, op)
        comm.reduce(b, root, op)
        expect = ref.reduce(theirs(count, op), root, op)[me]
        assert_equal(b, expect if me == root else values(dtype, count, me, op=op, seed=seed),
                     what)
    elif kind == "allgather":
        out = empty(dtype, count * n)
        comm.allgather(mine(count), out)
        assert_equal(out, np.concatenate(theirs(count)), what)
    elif kind == "allgatherv":
        counts = [(count + 7 * r) % 97 for r in range(n)]
        out = empty(dtype, sum(counts))
        comm.allgatherv(make(dtype, counts[me], me, seed=seed), out, counts)
        assert_equal(out, np.concatenate([values(dtype, counts[r], r, seed=seed)
                                          for r in range(n)]), what)
    elif kind == "gather":
        out = empty(dtype, count * n) if me == root else None
        comm.gather(mine(count), out, root)
        if me == root:
            assert_equal(out, np.concatenate(theirs(count)), what)
    elif kind == "scatter":
        out = empty(dtype, count)
        comm.scatter(make(dtype, count * n, root, seed=seed) if me == root else None, out,
                     root)
        src = values(dtype, count * n, root, seed=seed)
        assert_equal(out, src[me * count:(me + 1) * count], what)
    elif kind == "reduce_scatter":
        out = empty(dtype, count)
        comm.reduce_scatter(mine(count * n, op), out, op)
        full = ref.allreduce(theirs(count * n, op), op)[0]
        assert_equal(out, full[me * count:(me + 1) * count], what)
    elif kind == "alltoall":
        out = empty(dtype, count * n)
        comm.alltoall(mine(count * n), out)
        assert_equal(out, ref.alltoall(theirs(count * n))[me], what)
    elif kind == "alltoallv":
        sc = [[(count + 3 * s + 5 * d) % 53 for d in range(n)] for s in range(n)]
        out = empty(dtype, sum(sc[s][me] for s in range(n)))
        comm.alltoallv(make(dtype, sum(sc[me]), me, seed=seed), sc[me], out,
                       [sc[s][me] for s in range(n)])
        ins = [values(dtype, sum(sc[s]), s, seed=seed) for s in range(n)]
        expect = np.concatenate([ins[s][sum(sc[s][:me]):sum(sc[s][:me + 1])]
                                 for s in range(n)])
        assert_equal(out, expect, what)
    else:
        comm.barrier()
    return kind


def case_soak(comm: Any, ops: int, seed: int = 1234) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    rss: list[tuple[int, int]] = []
    t0 = time.monotonic()
    warm = min(1000, ops // 5)
    for i in range(ops):
        kind = one_op(comm, i, rng)
        counts[kind] = counts.get(kind, 0) + 1
        if i == warm or (i > warm and i % 1000 == 0) or i == ops - 1:
            rss.append((i, rss_bytes()))
    return {"ops": ops, "seconds": time.monotonic() - t0, "kinds": counts, "rss": rss}
