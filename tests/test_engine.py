"""The compiled shared-memory engine (plait.transport._engine): its reductions against the
reference in one process, its rounding of 16-bit floats, its waits (a late peer, a peer
that never comes) and its fast path, on real rank processes."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest

from plait.testing import reference as ref
from plait.testing.data import DTYPE_NAMES, FLOAT_DTYPES, assert_equal, make, values

PAIRS = list(itertools.product(DTYPE_NAMES, ref.OPS))


def _storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """What the engine reduces: bfloat16 as its uint16 bits."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(a)


def _from_storage(a: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return a


def _defined(dtype: str, op: str) -> bool:
    if dtype in FLOAT_DTYPES:
        return op not in ref.BITWISE
    return op != "avg"


# ---------------------------------------------------------- reductions in one process


@pytest.mark.parametrize(("dtype", "op"), PAIRS)
def test_engine_reduce_matches_reference(dtype: str, op: str) -> None:
    from plait.reduce import ReduceOp, divide
    from plait.transport.engine import reduce_into

    rop = ReduceOp.parse(op)
    if not _defined(dtype, op):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            return  # AVG is SUM plus a division here: plait.calls refuses it for integers
        with pytest.raises(TypeError, match="not defined"):
            reduce_into(np.zeros(4, np.uint8), np.zeros(4, np.uint8), dtype, rop)
        return
    # 0, 1, odd, and more than the kernels' block (2048 elements)
    for count, size in ((0, 2), (1, 3), (7, 5), (5003, 3)):
        inputs = [values(dtype, count, r, op=op) for r in range(size)]
        acc = _storage(inputs[0], dtype).copy()
        for a in inputs[1:]:
            reduce_into(acc, _storage(a, dtype), dtype, rop)
        if rop is ReduceOp.AVG:
            from plait.reduce import DTYPES

            divide(acc, DTYPES[dtype], size)
        assert_equal(_from_storage(acc, dtype), ref.reduce_arrays(inputs, op, dtype),
                     f"{dtype} {op} count {count} over {size}")


def test_engine_reduce_nan_and_wraparound() -> None:
    from plait.reduce import ReduceOp
    from plait.transport.engine import reduce_into

    a = np.array([np.nan, 1.0, -2.0, np.inf], np.float32)
    b = np.array([0.0, np.nan, 3.0, -np.inf], np.float32)
    for rop, want in ((ReduceOp.MAX, np.maximum(a, b)), (ReduceOp.MIN, np.minimum(a, b))):
        got = a.copy()
        reduce_into(got, b, "float32", rop)
        assert_equal(got, want, rop.name)
        assert np.isnan(got[0]) and np.isnan(got[1]), got  # NaN wins, as in numpy
    x = np.array([127, -128, 100], np.int8)
    reduce_into(x, np.array([1, -1, 100], np.int8), "int8", ReduceOp.SUM)
    assert x.tolist() == [-128, 127, -56]


def test_engine_reduce_rejects_bad_buffers() -> None:
    from plait.reduce import ReduceOp
    from plait.transport.engine import reduce_into

    with pytest.raises(ValueError, match="equal whole buffers"):
        reduce_into(np.zeros(4, np.float32), np.zeros(3, np.float32), "float32", ReduceOp.SUM)
    with pytest.raises(TypeError, match="writable"):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        reduce_into(ro, np.zeros(4, np.float32), "float32", ReduceOp.SUM)


# -------------------------------------------------------- 16-bit floats: rounded once


def case_half_rounds_once(comm: Any) -> None:
    """3 ranks: rank 0 gives 2048 + 4i at element i in float16, the others 1: accumulated
    in float32 and rounded once that is 2050 + 4i; rounding after every add would lose
    both ones (2049 + 4i is a tie that rounds to the even 2048 + 4i). The same from 256 in
    bfloat16 (spacing 2 there too). The base depends on the index, so a misplaced
    element shows."""
    import torch

    def data(count: int, dtype: Any, big: float) -> Any:
        if comm.rank == 0:
            return (big + 4 * torch.arange(count, dtype=torch.float64)).to(dtype)
        return torch.ones(count, dtype=dtype)

    for dtype, big in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
        want = [big + 2 + 4 * i for i in range(6)]
        t = data(6, dtype, big)
        comm.allreduce(t)
        assert t.tolist() == want, (dtype, t)
        # reduce and reduce_scatter fold the same way
        r = data(6, dtype, big)
        comm.reduce(r, 1)
        if comm.rank == 1:
            assert r.tolist() == want, (dtype, r)
        send = data(2 * comm.size, dtype, big)
        out = torch.empty(2, dtype=dtype)
        comm.reduce_scatter(send, out)
        assert out.tolist() == want[2 * comm.rank:2 * comm.rank + 2], (dtype, out)


def test_half_floats_rounded_once(pools: Any) -> None:
    pools.get(3, "shm").run(case_half_rounds_once)


# ---------------------------------------------------------------- waits: late peers


def case_late_peer(comm: Any, late: int) -> None:
    """Rank ``late`` enters each operation 0.2 s after the others: their waits outlast
    the spin, sleep on the doorbell and resume; every result is exact."""
    size, rank = comm.size, comm.rank
    ops: list[tuple[str, Any]] = []

    def allreduce() -> None:
        buf = make("float32", 300, rank, op="sum")
        comm.allreduce(buf)
        want = ref.allreduce([values("float32", 300, r, op="sum") for r in range(size)], "sum")
        assert_equal(buf, want[rank], "allreduce")

    def broadcast() -> None:
        buf = make("int32", 11, rank)
        comm.broadcast(buf, late)
        assert_equal(buf, values("int32", 11, late), "broadcast")

    def allgather() -> None:
        out = np.empty(5 * size, np.int64)
        comm.allgather(make("int64", 5, rank), out)
        assert_equal(out, np.concatenate([values("int64", 5, r) for r in range(size)]),
                     "allgather")

    def barrier() -> None:
        comm.barrier()

    ops = [("allreduce", allreduce), ("broadcast", broadcast), ("allgather", allgather),
           ("barrier", barrier)]
    for _name, fn in ops:
        if rank == late:
            time.sleep(0.2)
        fn()


@pytest.mark.parametrize("size", [2, 3])
def test_late_peer_wakes_waiters(pools: Any, size: int) -> None:
    pools.get(size, "shm").run(case_late_peer, size - 1)


def case_absent_peer_times_out(comm: Any) -> None:
    """Rank 1 never enters the allreduce: rank 0's engine wait ends at the deadline with
    the typed error naming the rank it waits for and the operation."""
    from plait.errors import CommTimeoutError

    if comm.rank == 0:
        buf = np.arange(4, dtype=np.float32)
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            comm.allreduce(buf)
        took = time.monotonic() - t0
        msg = str(info.value)
        assert "rank 0, allreduce #" in msg and "rank(s) 1" in msg, msg
        assert 0.9 < took < 5, took
    else:
        time.sleep(2.5)


def test_absent_peer_times_out(pools: Any) -> None:
    pools.get(2, "shm", timeout=1.0).run(case_absent_peer_times_out)


# ------------------------------------------------------------------------- fast path


def case_fast_path_falls_back(comm: Any) -> None:
    """What the fast path does not take goes the general way, with its messages; a
    rejected call takes no sequence number (the ranks stay in step)."""
    import torch

    rank, size = comm.rank, comm.size
    strided = np.arange(10, dtype=np.float32)[::2]
    with pytest.raises(ValueError, match=f"rank {rank}, allreduce: buf is not contiguous"):
        comm.allreduce(strided)
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce(ro)
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.allreduce(np.zeros(3, np.float32), "mean")
    # a tensor, a Parameter (a subclass: general path), a non-contiguous tensor's copy
    t = torch.arange(6, dtype=torch.float32) + rank
    comm.allreduce(t)
    assert t.tolist() == [size * i + size * (size - 1) / 2 for i in range(6)]
    p = torch.nn.Parameter(torch.arange(3, dtype=torch.float32) * (rank + 1),
                           requires_grad=False)
    comm.allreduce(p)
    assert p.tolist() == [i * size * (size + 1) / 2 for i in range(3)]
    a = np.arange(4, dtype=np.float64) + 2 * rank
    comm.allreduce(a, "avg")
    assert a.tolist() == [i + size - 1.0 for i in range(4)]
    # beyond the 1 KiB slot: the engine in many pieces, through the general path
    n = (1 << 20) // 4
    big = make("float32", n, rank, op="sum")
    comm.allreduce(big)
    assert_equal(big, ref.allreduce([values("float32", n, r, op="sum") for r in range(size)],
                                    "sum")[rank], "1 MiB allreduce")


def test_fast_path_falls_back(pools: Any) -> None:
    pools.get(2, "shm").run(case_fast_path_falls_back)


# ------------------------------------------------------- single copies and their fallback


def case_inplace_ops(comm: Any, forbid: bool) -> None:
    """Every operation by the in-place algorithm, at sizes of 0, 1, odd and several
    slots and scratch chunks; with ``forbid``, rank 1 says it cannot read its peers'
    memory (as where process_vm_readv is refused) and every rank falls back to the
    slots, alike."""
    if forbid and comm.rank == 1:
        comm._fabric.host.board.forbid_single_copy()  # private: no public switch for this
    size, rank = comm.size, comm.rank
    for count in (0, 1, 7, 70001):
        ins = [values("float32", count, r, op="sum") for r in range(size)]
        buf = make("float32", count, rank, op="sum")
        comm.allreduce(buf)
        assert_equal(buf, ref.allreduce(ins, "sum")[rank], f"allreduce {count}")
        buf = make("float32", count, rank, op="sum")
        comm.reduce(buf, size - 1)
        assert_equal(buf, ref.reduce(ins, size - 1, "sum")[rank], f"reduce {count}")
        buf = make("int64", count, rank)
        comm.broadcast(buf, 1)
        assert_equal(buf, values("int64", count, 1), f"broadcast {count}")
        out = np.empty(count * size, np.int64)
        comm.allgather(make("int64", count, rank), out)
        assert_equal(out, np.concatenate([values("int64", count, r) for r in range(size)]),
                     f"allgather {count}")
        big = [values("int32", count * size, r, op="sum") for r in range(size)]
        rs = np.empty(count, np.int32)
        comm.reduce_scatter(make("int32", count * size, rank, op="sum"), rs)
        assert_equal(rs, ref.reduce_scatter(big, "sum", "int32")[rank], f"reduce_scatter {count}")
        a2a = np.empty(count * size, np.int32)
        comm.alltoall(make("int32", count * size, rank, op="sum"), a2a)
        assert_equal(a2a, ref.alltoall(big)[rank], f"alltoall {count}")
        g = np.empty(count * size, np.int64) if rank == 0 else None
        comm.gather(make("int64", count, rank), g, 0)
        if rank == 0:
            assert_equal(g, np.concatenate([values("int64", count, r) for r in range(size)]),
                         f"gather {count}")
        sc = np.empty(count, np.int64)
        comm.scatter(np.concatenate([values("int64", count, r) for r in range(size)])
                     if rank == 2 % size else None, sc, 2 % size)
        assert_equal(sc, values("int64", count, rank), f"scatter {count}")
    fallbacks = comm._fabric.host.board.fallbacks  # private: what ran where
    assert (fallbacks >= 32) if forbid else (fallbacks == 0), fallbacks


INPLACE = ("allreduce:inplace;reduce:inplace;broadcast:inplace;allgather:inplace;"
           "reduce_scatter:inplace;alltoall:inplace;gather:inplace;scatter:inplace")


@pytest.mark.parametrize("size", [2, 3, 5])
def test_inplace_single_copies(pools: Any, size: int) -> None:
    pools.get(size, "shm", env={"PLAIT_ALGO": INPLACE}).run(case_inplace_ops, False)


def test_inplace_falls_back_to_the_slots(pools: Any) -> None:
    # a pool of its own (the barrier rule only makes its key differ): the switch stays
    pools.get(3, "shm", env={"PLAIT_ALGO": INPLACE + ";barrier:direct"}).run(
        case_inplace_ops, True)


def _killed_mid_inplace(rank: int, port: int, q: Any) -> None:
    import os
    import signal
    import threading

    import plait

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("PLAIT_ALGO", None)
    comm = plait.init(rank, 3, timeout=60)
    buf = np.ones((8 << 20) // 4, np.float32)  # 8 MiB: the in-place algorithm
    comm.allreduce(buf)
    if rank == 2:
        # SIGKILL from a timer: lands at any point of an operation, reads of this
        # rank's memory included; the parent does not reap it (a zombie)
        threading.Timer(0.25 + 0.011 * (port % 13), os.kill,
                        (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            comm.allreduce(buf)
    except Exception as exc:  # what the survivors raise, and how fast
        q.put((rank, type(exc).__name__, str(exc), time.monotonic() - t0))
        return
    q.put((rank, "none", "", 0.0))


def test_peer_killed_during_single_copies_is_named() -> None:
    """A rank SIGKILLed while its peers read its memory: each survivor raises
    PeerFailedError naming it, well within the bound — never a raw OSError."""
    from plait.testing.spawn import run_ranks

    for _ in range(2):
        out = run_ranks(_killed_mid_inplace, 3, expect=2, timeout=60)
        for rank, kind, msg, took in out:
            assert kind == "PeerFailedError", (rank, kind, msg)
            assert "rank 2" in msg and took < 5, (rank, msg, took)
