"""Every (dtype, reduce op) pair: the reference against first principles, plait's own
reducers against the reference (one process), and reductions through the library
(allreduce, reduce, reduce_scatter on real rank processes)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from plait.testing import reference as ref
from plait.testing.data import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    INT_DTYPES,
    assert_equal,
    empty,
    from_numpy,
    make,
    values,
)

OPS = ref.OPS
PAIRS = list(itertools.product(DTYPE_NAMES, OPS))


def defined(dtype: str, op: str) -> bool:
    if dtype in FLOAT_DTYPES:
        return op not in ref.BITWISE
    return op != "avg"


# ------------------------------------------------------------------ pure: the reference


def _first_principles(dtype: str, op: str, rows: list[list[Any]]) -> list[Any]:
    """Element by element with Python numbers: the definition the reference must meet."""
    out = []
    for col in zip(*rows, strict=True):
        if dtype == "bool":
            col = [bool(v) for v in col]
            if op in ("sum", "bor", "max"):
                out.append(any(col))
            elif op in ("prod", "band", "min"):
                out.append(all(col))
            else:
                out.append(sum(col) % 2 == 1)
        elif dtype in INT_DTYPES:
            bits = np.dtype(dtype).itemsize * 8
            signed = np.dtype(dtype).kind == "i"
            col = [int(v) for v in col]
            acc = col[0]
            for v in col[1:]:
                acc = {"sum": acc + v, "prod": acc * v, "min": min(acc, v),
                       "max": max(acc, v), "band": acc & v, "bor": acc | v,
                       "bxor": acc ^ v}[op]
            acc &= (1 << bits) - 1
            if signed and acc >= 1 << (bits - 1):
                acc -= 1 << bits
            out.append(acc)
        else:
            col = [float(v) for v in col]
            acc = col[0]
            for v in col[1:]:
                acc = {"sum": acc + v, "avg": acc + v, "prod": acc * v,
                       "min": min(acc, v), "max": max(acc, v)}[op]
            if op == "avg":
                acc = acc / len(col)
            out.append(acc)
    return out


@pytest.mark.parametrize(("dtype", "op"), PAIRS)
def test_reference_matches_first_principles(dtype: str, op: str) -> None:
    for size in (1, 2, 3, 5):
        inputs = [values(dtype, 40, r, op=op) for r in range(size)]
        if not defined(dtype, op):
            with pytest.raises(TypeError, match=op.upper()):
                ref.reduce_arrays(inputs, op, dtype)
            continue
        got = ref.reduce_arrays(inputs, op, dtype)
        want = _first_principles(dtype, op, [a.tolist() for a in inputs])
        if dtype in FLOAT_DTYPES and op == "avg":
            # one rounding of the exact quotient to the dtype
            want_arr = np.asarray(
                ref.reduce_arrays([np.asarray(want, dtype=np.float64)], "sum", dtype))
        else:
            want_arr = np.asarray(want).astype(got.dtype)
        assert_equal(got, want_arr, f"{dtype} {op} over {size} ranks")


def test_data_exercises_wraparound() -> None:
    """The integer data must make SUM and PROD wrap, or the wrap rules go untested."""
    for dtype in INT_DTYPES:
        inputs = [values(dtype, 200, r, op="sum") for r in range(3)]
        exact = sum(a.astype(object) for a in inputs)
        info = np.iinfo(dtype)
        assert any(v > info.max or v < info.min for v in exact), dtype


def test_data_depends_on_rank_and_index() -> None:
    for dtype in DTYPE_NAMES:
        a, b = values(dtype, 64, 0), values(dtype, 64, 1)
        assert not np.array_equal(a, b), dtype
        assert len(set(a.tolist())) > 1, dtype
    # moves of wide dtypes: unique per (rank, index)
    for dtype in ("float32", "float64", "int32", "int64"):
        whole = np.concatenate([values(dtype, 5000, r) for r in range(5)])
        assert len(set(whole.tolist())) == whole.size, dtype


def test_float_sums_exact_in_any_order() -> None:
    rng = np.random.default_rng(0)
    for dtype in ("float16", "bfloat16", "float32"):
        inputs = [values(dtype, 300, r, op="sum") for r in range(5)]
        want = ref.reduce_arrays(inputs, "sum", dtype)
        for _ in range(5):
            order = rng.permutation(5)
            acc = from_numpy(inputs[order[0]], dtype, "torch")
            for i in order[1:]:
                acc = acc + from_numpy(inputs[i], dtype, "torch")  # in the dtype itself
            assert_equal(acc, want, f"{dtype} sum in order {order}")


def test_reference_moves() -> None:
    ins = [np.arange(6) + 10 * r for r in range(3)]
    assert [a.tolist() for a in ref.alltoall(ins)][1] == [2, 3, 12, 13, 22, 23]
    assert ref.scatter(np.arange(6), 3)[2].tolist() == [4, 5]
    assert ref.gather([np.array([r]) for r in range(3)], 1)[1].tolist() == [0, 1, 2]
    assert ref.gather([np.array([r]) for r in range(3)], 1)[0] is None
    assert ref.reduce(ins, 2, "max")[0].tolist() == ins[0].tolist()
    assert ref.reduce(ins, 2, "max")[2].tolist() == ins[2].tolist()
    assert ref.reduce_scatter(ins, "sum")[0].tolist() == [30, 33]
    outs, rc = ref.alltoallv([np.array([1, 2, 3]), np.array([4])], [[1, 2], [0, 1]])
    assert [o.tolist() for o in outs] == [[1], [2, 3, 4]]
    assert rc == [[1, 0], [2, 1]]
    assert ref.allgatherv([np.array([1]), np.array([], dtype=int)], [1, 0])[1].tolist() == [1]


def test_op_names() -> None:
    import torch.distributed as dist

    import plait

    assert ref.op_name("SuM") == "sum"
    assert ref.op_name(plait.ReduceOp.BXOR) == "bxor"
    assert ref.op_name(dist.ReduceOp.MAX) == "max"
    with pytest.raises(ValueError):
        ref.op_name("mean")


# ------------------------------------------------------- pure: plait's reducers vs reference


@pytest.mark.parametrize(("dtype", "op"), PAIRS)
def test_library_reducer_matches_reference(dtype: str, op: str) -> None:
    from plait.reduce import DTYPES, ReduceOp, divide

    dt = DTYPES[dtype]
    rop = ReduceOp.parse(op)
    if not defined(dtype, op):
        with pytest.raises(TypeError, match=rf"{rop.name}.*{dtype}"):
            dt.reducer(rop, rank=3, opname="allreduce")
        return
    fn = dt.reducer(rop)
    size = 5
    inputs = [values(dtype, 1500, r, op=op) for r in range(size)]

    def storage(a: np.ndarray) -> np.ndarray:
        if dtype == "bfloat16":
            import torch

            return torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(
                np.uint16)
        return a.copy()

    acc = storage(inputs[0])
    for a in inputs[1:]:
        fn(acc, storage(a))
    if rop is ReduceOp.AVG:
        divide(acc, dt, size)
    if dtype == "bfloat16":
        import torch

        got: Any = torch.from_numpy(acc.view(np.int16)).view(torch.bfloat16)
    else:
        got = acc
    assert_equal(got, ref.reduce_arrays(inputs, op, dtype), f"{dtype} {op}")


# --------------------------------------------------------------- through the library


def case_reduce_ops(comm: Any, dtype: str, op: str, count: int, lib: str) -> None:
    """allreduce, reduce (root = last rank) and reduce_scatter with one (dtype, op)."""
    size, rank = comm.size, comm.rank
    where = f"rank {rank}: {dtype} {op} count {count}"
    inputs = [values(dtype, count, r, op=op) for r in range(size)]
    buf = make(dtype, count, rank, op=op, lib=lib)
    comm.allreduce(buf, op=op)
    assert_equal(buf, ref.allreduce(inputs, op, dtype)[rank], "allreduce " + where)

    root = size - 1
    buf = make(dtype, count, rank, op=op, lib=lib)
    comm.reduce(buf, root, op=op)
    assert_equal(buf, ref.reduce(inputs, root, op, dtype)[rank], "reduce " + where)

    big = [values(dtype, count * size, r, op=op) for r in range(size)]
    send = make(dtype, count * size, rank, op=op, lib=lib)
    recv = empty(dtype, count, lib=lib)
    comm.reduce_scatter(send, recv, op=op)
    assert_equal(recv, ref.reduce_scatter(big, op, dtype)[rank], "reduce_scatter " + where)
    assert_equal(send, big[rank], "reduce_scatter must not change sendbuf " + where)


def case_undefined_op(comm: Any, dtype: str, op: str, lib: str) -> None:
    """An undefined (dtype, op) raises TypeError naming rank and op before communicating;
    the communicator stays usable."""
    buf = make(dtype, 7, comm.rank, op=op, lib=lib)
    before = values(dtype, 7, comm.rank, op=op)
    for call in (lambda: comm.allreduce(buf, op=op),
                 lambda: comm.reduce(buf, 0, op=op),
                 lambda: comm.reduce_scatter(make(dtype, 7 * comm.size, comm.rank, lib=lib),
                                             buf, op=op)):
        with pytest.raises(TypeError) as info:
            call()
        msg = str(info.value)
        assert f"rank {comm.rank}" in msg and op.upper() in msg.upper(), msg
        assert_equal(buf, before, "buffer changed by a rejected call")
    ok = make("float32", 5, comm.rank, op="sum")
    comm.allreduce(ok)
    assert_equal(ok, ref.allreduce([values("float32", 5, r, op="sum")
                                    for r in range(comm.size)], "sum")[comm.rank], "after")


def _lib(dtype: str, op: str) -> str:
    # bfloat16 exists only in torch; otherwise alternate numpy and torch
    if dtype == "bfloat16":
        return "torch"
    return "torch" if (DTYPE_NAMES.index(dtype) + OPS.index(op)) % 2 else "numpy"


DEFINED = [p for p in PAIRS if defined(*p)]
UNDEFINED = [p for p in PAIRS if not defined(*p)]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize(("dtype", "op"), DEFINED)
def test_reduce_ops_through_library(pools: Any, transport: str, dtype: str, op: str) -> None:
    pool = pools.get(3, transport)
    for count in (7, 1500):  # 1500 elements: more than the 1 KiB slot for every dtype
        pool.run(case_reduce_ops, dtype, op, count, _lib(dtype, op))


@pytest.mark.parametrize(("dtype", "op"), UNDEFINED)
def test_undefined_ops_raise_type_error(pools: Any, dtype: str, op: str) -> None:
    pools.get(2, "shm").run(case_undefined_op, dtype, op, _lib(dtype, op))


def case_op_spellings(comm: Any) -> None:
    import torch.distributed as dist

    import plait

    size, rank = comm.size, comm.rank
    for op in ("max", "MAX", "Max", plait.ReduceOp.MAX, dist.ReduceOp.MAX):
        buf = make("int32", 9, rank, op="max")
        comm.allreduce(buf, op=op)
        assert_equal(buf, ref.allreduce([values("int32", 9, r, op="max")
                                         for r in range(size)], "max")[rank], repr(op))
    with pytest.raises(ValueError, match=f"rank {rank}"):
        comm.allreduce(make("int32", 9, rank), op="mean")


def test_op_spellings(pools: Any) -> None:
    pools.get(2, "shm").run(case_op_spellings)


def case_float16_avg_mixed_libs(comm: Any) -> None:
    """numpy float16 and a torch float16 tensor in one call (reduce_scatter)."""
    import torch

    size, rank = comm.size, comm.rank
    send = make("float16", 4 * size, rank, op="avg")
    recv = torch.full((4,), 77.0, dtype=torch.float16)
    comm.reduce_scatter(send, recv, op="avg")
    inputs = [values("float16", 4 * size, r, op="avg") for r in range(size)]
    assert_equal(recv, ref.reduce_scatter(inputs, "avg", "float16")[rank], "mixed libs")


def test_mixed_numpy_and_torch(pools: Any) -> None:
    pools.get(3, "tcp").run(case_float16_avg_mixed_libs)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp", "mixed"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("dtype", "op"), DEFINED)
def test_reduce_ops_every_world(pools: Any, world: int, transport: str, dtype: str, op: str,
                                ) -> None:
    pool = pools.get(world, transport)
    for count in (0, 1, 7, 1500):
        pool.run(case_reduce_ops, dtype, op, count, _lib(dtype, op))
