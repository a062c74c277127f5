"""Every collective against the reference, on real rank processes.

The default-tier sweep: every operation x world size {1..5} x count {0, 1, 7, larger
than the shrunk slot and chunk} x transport {shm, tcp}; then the mixed pool (two fake
hosts: shm and TCP in one communicator), every algorithm forced through ``PLAIT_ALGO``,
and async operations completing in issue order.

Each ``check_*`` function runs on every rank: it rebuilds every rank's input from
:mod:`plait.testing.data`, runs the operation and compares its own output with the
reference (other test modules reuse them).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from plait.testing import reference as ref
from plait.testing.data import assert_equal, empty, make, values
from plait.testing.harness import BIG_COUNT
from plait.tuning.selector import ALGORITHMS

WORLDS = (1, 2, 3, 4, 5)
TRANSPORTS = ("shm", "tcp")
OPS = ("allreduce", "reduce", "broadcast", "allgather", "allgatherv", "gather", "scatter",
       "reduce_scatter", "alltoall", "alltoallv", "sendrecv")
SMALL_DTYPES = ("float64", "int8", "float16", "bool", "uint8", "int16", "int32", "bfloat16",
                "int64", "float32", "float16")


def counts_for(op: str) -> list[tuple[int, str, str]]:
    """(count, dtype, lib) of the sweep: 0, 1, 7 and BIG_COUNT (12 KB of float32: more
    than the 1 KiB slot, the 4 KiB chunk and the 16 KiB ring for most operations)."""
    small = SMALL_DTYPES[OPS.index(op) % len(SMALL_DTYPES)]
    return [(0, "float32", "numpy"), (1, "int64", "torch"),
            (7, small, "torch" if small == "bfloat16" else "numpy"),
            (BIG_COUNT, "float32", "torch")]


def roots(size: int) -> list[int]:
    return sorted({0, size // 2, size - 1})


def vcounts(count: int, size: int, seed: int = 0) -> list[int]:
    """Uneven per-rank counts with zeros (all zero when count is 0)."""
    if count == 0:
        return [0] * size
    return [0 if (r + seed) % 3 == 1 else count + 2 * r for r in range(size)]


def vmatrix(count: int, size: int) -> list[list[int]]:
    """send_counts[s][d] for alltoallv: uneven, with zeros."""
    return [[(count + (s * d) % 3) if count and (s + 2 * d) % 3 != 1 else 0
             for d in range(size)] for s in range(size)]


def _tag(comm: Any, opname: str, **what: Any) -> str:
    extra = " ".join(f"{k}={v}" for k, v in what.items())
    return f"rank {comm.rank}/{comm.size} {opname} {extra}"


# ------------------------------------------------------------------------------ checks


def check_allreduce(comm: Any, count: int, dtype: str, lib: str, op: str = "sum") -> None:
    inputs = [values(dtype, count, r, op=op) for r in range(comm.size)]
    buf = make(dtype, count, comm.rank, op=op, lib=lib)
    comm.allreduce(buf, op=op)
    assert_equal(buf, ref.allreduce(inputs, op, dtype)[comm.rank],
                 _tag(comm, "allreduce", count=count, dtype=dtype, op=op))


def check_reduce(comm: Any, count: int, dtype: str, lib: str, op: str = "sum") -> None:
    inputs = [values(dtype, count, r, op=op) for r in range(comm.size)]
    for root in roots(comm.size):
        buf = make(dtype, count, comm.rank, op=op, lib=lib)
        comm.reduce(buf, root, op=op)
        assert_equal(buf, ref.reduce(inputs, root, op, dtype)[comm.rank],
                     _tag(comm, "reduce", count=count, dtype=dtype, root=root))


def check_broadcast(comm: Any, count: int, dtype: str, lib: str) -> None:
    for root in roots(comm.size):
        inputs = [values(dtype, count, r, seed=root) for r in range(comm.size)]
        buf = make(dtype, count, comm.rank, seed=root, lib=lib)
        comm.broadcast(buf, root)
        assert_equal(buf, ref.broadcast(inputs, root)[comm.rank],
                     _tag(comm, "broadcast", count=count, dtype=dtype, root=root))


def check_allgather(comm: Any, count: int, dtype: str, lib: str) -> None:
    inputs = [values(dtype, count, r) for r in range(comm.size)]
    send = make(dtype, count, comm.rank, lib=lib)
    recv = empty(dtype, count * comm.size, lib=lib)
    comm.allgather(send, recv)
    what = _tag(comm, "allgather", count=count, dtype=dtype)
    assert_equal(recv, ref.allgather(inputs)[comm.rank], what)
    assert_equal(send, inputs[comm.rank], what + " changed sendbuf")


def check_allgatherv(comm: Any, count: int, dtype: str, lib: str) -> None:
    for seed in (0, 1):
        counts = vcounts(count, comm.size, seed)
        inputs = [values(dtype, counts[r], r, seed=seed) for r in range(comm.size)]
        send = make(dtype, counts[comm.rank], comm.rank, seed=seed, lib=lib)
        recv = empty(dtype, sum(counts), lib=lib)
        comm.allgatherv(send, recv, counts)
        assert_equal(recv, ref.allgatherv(inputs, counts)[comm.rank],
                     _tag(comm, "allgatherv", counts=counts, dtype=dtype))


def check_gather(comm: Any, count: int, dtype: str, lib: str) -> None:
    for root in roots(comm.size):
        inputs = [values(dtype, count, r, seed=root) for r in range(comm.size)]
        send = make(dtype, count, comm.rank, seed=root, lib=lib)
        # non-root ranks pass None as the issue allows, except one that passes a buffer
        recv = (empty(dtype, count * comm.size, lib=lib)
                if comm.rank == root or comm.rank == (root + 1) % comm.size else None)
        untouched = None if recv is None else empty(dtype, count * comm.size, lib=lib)
        comm.gather(send, recv, root)
        what = _tag(comm, "gather", count=count, dtype=dtype, root=root)
        if comm.rank == root:
            assert_equal(recv, ref.gather(inputs, root)[root], what)
        elif recv is not None:
            assert_equal(recv, untouched, what + ": a non-root recvbuf was written")


def check_scatter(comm: Any, count: int, dtype: str, lib: str) -> None:
    for root in roots(comm.size):
        whole = values(dtype, count * comm.size, root, seed=root)
        send = (make(dtype, count * comm.size, root, seed=root, lib=lib)
                if comm.rank == root or comm.rank == (root + 1) % comm.size else None)
        recv = empty(dtype, count, lib=lib)
        comm.scatter(send, recv, root)
        assert_equal(recv, ref.scatter(whole, comm.size)[comm.rank],
                     _tag(comm, "scatter", count=count, dtype=dtype, root=root))


def check_reduce_scatter(comm: Any, count: int, dtype: str, lib: str, op: str = "sum",
                         ) -> None:
    inputs = [values(dtype, count * comm.size, r, op=op) for r in range(comm.size)]
    send = make(dtype, count * comm.size, comm.rank, op=op, lib=lib)
    recv = empty(dtype, count, lib=lib)
    comm.reduce_scatter(send, recv, op=op)
    what = _tag(comm, "reduce_scatter", count=count, dtype=dtype, op=op)
    assert_equal(recv, ref.reduce_scatter(inputs, op, dtype)[comm.rank], what)
    assert_equal(send, inputs[comm.rank], what + " changed sendbuf")


def check_alltoall(comm: Any, count: int, dtype: str, lib: str) -> None:
    inputs = [values(dtype, count * comm.size, r) for r in range(comm.size)]
    send = make(dtype, count * comm.size, comm.rank, lib=lib)
    recv = empty(dtype, count * comm.size, lib=lib)
    comm.alltoall(send, recv)
    what = _tag(comm, "alltoall", count=count, dtype=dtype)
    assert_equal(recv, ref.alltoall(inputs)[comm.rank], what)
    assert_equal(send, inputs[comm.rank], what + " changed sendbuf")


def check_alltoallv(comm: Any, count: int, dtype: str, lib: str) -> None:
    sc = vmatrix(count, comm.size)
    inputs = [values(dtype, sum(sc[r]), r) for r in range(comm.size)]
    outs, rcs = ref.alltoallv(inputs, sc)
    send = make(dtype, sum(sc[comm.rank]), comm.rank, lib=lib)
    recv = empty(dtype, sum(rcs[comm.rank]), lib=lib)
    comm.alltoallv(send, sc[comm.rank], recv, rcs[comm.rank])
    assert_equal(recv, outs[comm.rank], _tag(comm, "alltoallv", send_counts=sc[comm.rank],
                                             recv_counts=rcs[comm.rank], dtype=dtype))


def check_sendrecv(comm: Any, count: int, dtype: str, lib: str) -> None:
    """Every rank sends to every other rank (tag = distance) and receives from each."""
    size, rank = comm.size, comm.rank
    sends = []
    for k in range(1, size):
        buf = make(dtype, count, rank, seed=k, lib=lib)
        sends.append((comm.isend(buf, (rank + k) % size, tag=k), buf))
    for k in range(1, size):
        src = (rank - k) % size
        buf = empty(dtype, count, lib=lib)
        got = comm.recv(buf, src, tag=k)
        assert got == src
        assert_equal(buf, values(dtype, count, src, seed=k),
                     _tag(comm, "recv", src=src, tag=k, count=count, dtype=dtype))
    for work, _buf in sends:
        assert work.wait() is True


def check_barrier(comm: Any, count: int = 0, dtype: str = "", lib: str = "") -> None:
    comm.barrier()


CHECKS = {name[6:]: fn for name, fn in globals().items() if name.startswith("check_")}


def case_ops(comm: Any, ops: list[str], count: int, dtype: str, lib: str) -> None:
    """Run the checks of ``ops`` in order (a case: one round trip to the ranks)."""
    for op in ops:
        CHECKS[op](comm, count, dtype, lib)


# ------------------------------------------------------------------------------ the sweep


def _sweep_params() -> list[Any]:
    out = []
    for op in OPS:
        for count, dtype, lib in counts_for(op):
            out.append(pytest.param(op, count, dtype, lib, id=f"{op}-{count}-{dtype}-{lib}"))
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("op", "count", "dtype", "lib"), _sweep_params())
def test_sweep(pools: Any, world: int, transport: str, op: str, count: int, dtype: str,
               lib: str) -> None:
    if op == "sendrecv" and world == 1:
        pytest.skip("point-to-point needs two ranks")
    pools.get(world, transport).run(case_ops, [op], count, dtype, lib)


def case_barrier(comm: Any) -> tuple[float, float]:
    time.sleep(0.05 * ((comm.rank * 3) % comm.size))  # ranks arrive out of order
    enter = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process here
    comm.barrier()
    return enter, time.monotonic()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_barrier(pools: Any, world: int, transport: str) -> None:
    pool = pools.get(world, transport)
    for _ in range(2):
        times = pool.run(case_barrier)
        last_enter = max(t[0] for t in times)
        first_exit = min(t[1] for t in times)
        assert first_exit >= last_enter, f"a rank left the barrier early: {times}"


# --------------------------------------------------------------------------- mixed pool


@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("count", [7, BIG_COUNT])
def test_mixed_hosts_every_op(pools: Any, world: int, count: int) -> None:
    """Two fake hosts: shm inside each, TCP between them, in one communicator."""
    pool = pools.get(world, "mixed")
    for op in OPS:
        _n, dtype, lib = counts_for(op)[2 if count == 7 else 3]
        pool.run(case_ops, [op, "barrier"], count, dtype, lib)


# ----------------------------------------------------------------- every algorithm forced


def _algo_params() -> list[Any]:
    out = []
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            for world in (3, 5):
                for transport in TRANSPORTS:
                    if algo in ("direct", "slices", "inplace") and transport == "tcp":
                        continue  # the engine's algorithms need every rank on one host
                    if algo == "hier":
                        continue  # needs equal ranks on several hosts: tests/test_hier.py
                    out.append(pytest.param(op, algo, world, transport,
                                            id=f"{op}:{algo}-{transport}-{world}"))
    return out


ALGO_CHECKS = {"allgather": ["allgather", "allgatherv"], "alltoall": ["alltoall", "alltoallv"]}


@pytest.mark.parametrize(("op", "algo", "world", "transport"), _algo_params())
def test_forced_algorithm(pools: Any, op: str, algo: str, world: int, transport: str) -> None:
    pool = pools.get(world, transport, env={"PLAIT_ALGO": f"{op}:{algo}"})
    checks = ALGO_CHECKS.get(op, [op])
    if algo in ("direct", "inplace"):
        checks = [c for c in checks if c != "alltoallv"]  # the engine has no alltoallv
    # the pools' slot is 1 KiB: the larger counts go through the engine in many pieces
    cases = [(1, "int32", "numpy"), (7, "float16", "torch"), (BIG_COUNT, "float32", "numpy"),
             (BIG_COUNT * 3 + 1, "int64", "numpy")]
    for count, dtype, lib in cases:
        pool.run(case_ops, checks, count, dtype, lib)


def case_ring_allreduce_sizes(comm: Any) -> None:
    """Counts around multiples of the world size and of the chunk (ring segmentation)."""
    for count in (2, 3, comm.size - 1, comm.size + 1, 1023, 1024, 1025, 4097):
        check_allreduce(comm, max(count, 0), "float32", "numpy")
        check_reduce_scatter(comm, max(count, 0), "int32", "numpy")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ring_odd_sizes(pools: Any, transport: str) -> None:
    pools.get(5, transport, env={"PLAIT_ALGO": "allreduce:ring;reduce_scatter:ring"}).run(
        case_ring_allreduce_sizes)


# ------------------------------------------------------------------------------- async ops


def case_async_in_order(comm: Any, count: int) -> None:
    """Several outstanding async collectives (and a sync one behind them) complete in
    issue order with the right results."""
    size, rank = comm.size, comm.rank
    a = make("float32", count, rank, op="sum")
    b = make("int32", count, rank, seed=1)
    c_send, c_recv = make("float64", count, rank), empty("float64", count * size)
    d_send, d_recv = make("int16", count * size, rank), empty("int16", count * size)
    e_send, e_recv = make("float32", count * size, rank, op="max"), empty("float32", count)
    works = [
        comm.allreduce(a, async_op=True),
        comm.broadcast(b, size - 1, async_op=True),
        comm.allgather(c_send, c_recv, async_op=True),
        comm.alltoall(d_send, d_recv, async_op=True),
        comm.barrier(async_op=True),
        comm.reduce_scatter(e_send, e_recv, op="max", async_op=True),
    ]
    f = make("float32", count, rank, op="sum", seed=2)
    comm.allreduce(f)  # sync, behind the queued ones: completes after them
    done = [w.is_completed() for w in works]
    for w in reversed(works):
        assert w.wait() is True
        assert w.is_completed()
        assert w.exception() is None
        assert w.source is None
    assert all(done), f"rank {rank}: a sync op finished before earlier async ones: {done}"
    ins = lambda dt, n, **kw: [values(dt, n, r, **kw) for r in range(size)]  # noqa: E731
    assert_equal(a, ref.allreduce(ins("float32", count, op="sum"), "sum")[rank], "a")
    assert_equal(b, ref.broadcast(ins("int32", count, seed=1), size - 1)[rank], "b")
    assert_equal(c_recv, ref.allgather(ins("float64", count))[rank], "c")
    assert_equal(d_recv, ref.alltoall(ins("int16", count * size))[rank], "d")
    assert_equal(e_recv, ref.reduce_scatter(ins("float32", count * size, op="max"),
                                            "max")[rank], "e")
    assert_equal(f, ref.allreduce(ins("float32", count, op="sum", seed=2), "sum")[rank], "f")


@pytest.mark.parametrize("transport", [*TRANSPORTS, "mixed"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_async_ops_complete_in_order(pools: Any, world: int, transport: str) -> None:
    pool = pools.get(world, transport)
    for count in (1, BIG_COUNT):
        pool.run(case_async_in_order, count)


def case_many_outstanding(comm: Any, n: int) -> None:
    """n async allreduces in flight at once, waited in issue order."""
    bufs = [make("int64", 33, comm.rank, op="sum", seed=i) for i in range(n)]
    works = [comm.allreduce(b, async_op=True) for b in bufs]
    for i, (w, b) in enumerate(zip(works, bufs, strict=True)):
        w.wait()
        assert_equal(b, ref.allreduce([values("int64", 33, r, op="sum", seed=i)
                                       for r in range(comm.size)], "sum")[comm.rank], f"#{i}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_outstanding_async(pools: Any, transport: str) -> None:
    pools.get(4, transport).run(case_many_outstanding, 50)


# ------------------------------------------------------------------ slow tier: everything

ALL_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
              "int64", "bool")


@pytest.mark.slow
@pytest.mark.parametrize("transport", [*TRANSPORTS, "mixed"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_full_cross_product(pools: Any, world: int, transport: str, op: str, dtype: str,
                            ) -> None:
    if op == "sendrecv" and world == 1:
        pytest.skip("point-to-point needs two ranks")
    pool = pools.get(world, transport)
    for count in (0, 1, 7, BIG_COUNT, 3 * BIG_COUNT + 1):
        for lib in ("torch",) if dtype == "bfloat16" else ("numpy", "torch"):
            pool.run(case_ops, [op], count, dtype, lib)


# ------------------------------------------------------- single-copy (process_vm_readv)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_single_copy_transfers(pools: Any, world: int) -> None:
    """With a 1 KiB threshold every large ring message is read straight from the sender's
    memory (both the copy and the reduce forms); results must not change."""
    pool = pools.get(world, "shm", env={
        "PLAIT_CMA_MIN_SIZE": "1K",
        "PLAIT_ALGO": "allreduce:ring;broadcast:chain;allgather:ring;reduce_scatter:ring;"
                      "alltoall:pairwise;gather:linear;scatter:linear;reduce:tree"})
    ops = ["allreduce", "broadcast", "reduce", "allgather", "allgatherv", "reduce_scatter",
           "alltoall", "alltoallv", "gather", "scatter"]
    cases = [(BIG_COUNT, "float32", "numpy"), (BIG_COUNT * 3 + 1, "int64", "torch"),
             (BIG_COUNT, "bfloat16", "torch")]
    for count, dtype, lib in cases:
        pool.run(case_ops, ops, count, dtype, lib)
    # every rank verified every peer's memory and so really read through process_vm_readv
    peers = pool.run(case_cma_peers)
    assert peers == [[p for p in range(world) if p != r] for r in range(world)]


def case_cma_peers(comm: Any) -> list[int]:
    return sorted(comm.describe()["single_copy_from"])
