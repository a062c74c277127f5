"""Every torch.distributed operation on the plait backend, compared with gloo.

Each case runs on every rank of a torch world (conftest.py): the default group is plait,
``w.gloo`` is a gloo group over the same ranks, and both get the same exact inputs, which
depend on rank and element index (plait.testing.data). Results must be identical. Where
gloo has no answer (AVG, PREMUL_SUM, uneven all_gather), numpy's reference
(plait.testing.reference) is the oracle. World sizes 2, 3 and 4.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from plait_torch_world import TORCH_DTYPES, World, data, same

from plait.testing import reference
from plait.testing.data import DTYPE_NAMES, FLOAT_DTYPES, values
from plait.testing.harness import BIG_COUNT

SIZES = (2, 3, 4)
COUNTS = (0, 1, 7, BIG_COUNT)
RO = dist.ReduceOp
TORCH_OPS = {"sum": RO.SUM, "prod": RO.PRODUCT, "min": RO.MIN, "max": RO.MAX,
             "band": RO.BAND, "bor": RO.BOR, "bxor": RO.BXOR}


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, worlds: Any) -> Any:
    return worlds.get(request.param)


def _valid(dtype: str, op: str) -> bool:
    if dtype in FLOAT_DTYPES:
        return op not in ("band", "bor", "bxor")
    return op != "avg"


def _ref(dtype: str, count: int, size: int, op: str, seed: int = 0) -> torch.Tensor:
    """numpy's reduction of every rank's input, as a tensor of ``dtype``."""
    inputs = [values(dtype, count, r, op=op, seed=seed) for r in range(size)]
    out = reference.reduce_arrays(inputs, op, dtype)
    t = torch.from_numpy(np.ascontiguousarray(out))
    return t.to(TORCH_DTYPES[dtype])


def _vs_gloo(mine: torch.Tensor, theirs: Any, what: str) -> bool:
    """Compare with gloo's result; False (no comparison) where gloo raised."""
    if isinstance(theirs, BaseException):
        return False
    same(mine, theirs, what + " vs gloo")
    return True


def _both(w: World, fn: Any) -> tuple[Any, Any]:
    """``fn(group)`` on plait (the default group) and on gloo; gloo's error is returned."""
    mine = fn(None)
    try:
        theirs = fn(w.gloo)
    except (RuntimeError, ValueError) as exc:
        theirs = exc
    return mine, theirs


# -- all_reduce: every dtype x reduce op --------------------------------------------------

def case_all_reduce(w: World) -> dict[str, int]:
    compared = {"gloo": 0, "numpy": 0}
    for dtype in DTYPE_NAMES:
        for op, top in TORCH_OPS.items():
            if not _valid(dtype, op):
                continue
            for count in COUNTS:
                what = f"all_reduce {dtype} {op} count={count}"
                src = data(dtype, count, w.rank, op=op)

                def run(group: Any, src: torch.Tensor = src, top: Any = top) -> torch.Tensor:
                    t = src.clone()
                    dist.all_reduce(t, op=top, group=group)
                    return t

                mine, theirs = _both(w, run)
                same(mine, _ref(dtype, count, w.size, op), what + " vs numpy")
                compared["numpy"] += 1
                if isinstance(theirs, torch.Tensor):
                    same(mine, theirs, what + " vs gloo")
                    compared["gloo"] += 1
    return compared


def case_all_reduce_avg_premul(w: World) -> None:
    for dtype in FLOAT_DTYPES:
        for count in COUNTS:
            t = data(dtype, count, w.rank, op="avg")
            dist.all_reduce(t, op=RO.AVG)
            same(t, _ref(dtype, count, w.size, "avg"), f"AVG {dtype} count={count}")
            for factor in (0.5, torch.tensor([0.25], dtype=TORCH_DTYPES[dtype])):
                t = data(dtype, count, w.rank, op="sum")
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
                f = 0.5 if isinstance(factor, float) else 0.25
                inputs = [values(dtype, count, r, op="sum").astype(np.float64) * f
                          for r in range(w.size)]
                expect = torch.from_numpy(np.sum(inputs, axis=0) if count else
                                          np.zeros(0)).to(TORCH_DTYPES[dtype])
                same(t, expect, f"PREMUL_SUM({f}) {dtype} count={count}")
    # integer AVG is an error, raised before any communication, on every rank
    with pytest.raises(TypeError, match="AVG"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=RO.AVG)
    # PREMUL_SUM through reduce and reduce_scatter_tensor: non-root inputs unchanged
    t = data("float32", 7, w.rank, op="sum")
    before = t.clone()
    dist.reduce(t, dst=0, op=dist._make_nccl_premul_sum(2.0))
    if w.rank == 0:
        same(t, _ref("float32", 7, w.size, "sum") * 2, "reduce PREMUL_SUM")
    else:
        same(t, before, "reduce PREMUL_SUM leaves non-root input unchanged")
    inp = data("float64", 3 * w.size, w.rank, op="sum")
    out = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_single(out, inp, op=dist._make_nccl_premul_sum(0.5))
    full = _ref("float64", 3 * w.size, w.size, "sum") * 0.5
    same(out, full[3 * w.rank:3 * w.rank + 3], "reduce_scatter_tensor PREMUL_SUM")


# -- rooted: broadcast, reduce, gather, scatter -----------------------------------------------

ROOTED_DTYPES = ("float32", "bfloat16", "int64", "uint8", "bool")


def case_rooted(w: World) -> None:
    for dtype in ROOTED_DTYPES:
        for count in COUNTS:
            for root in range(w.size):
                what = f"{dtype} count={count} root={root}"
                src = data(dtype, count, w.rank, seed=root)

                def bcast(g: Any, src: torch.Tensor = src, root: int = root) -> torch.Tensor:
                    t = src.clone()
                    dist.broadcast(t, src=root, group=g)
                    return t

                mine, theirs = _both(w, bcast)
                same(mine, theirs, "broadcast " + what)
                op = "max" if dtype == "bool" else "sum"
                rsrc = data(dtype, count, w.rank, op=op, seed=root)

                def red(g: Any, rsrc: torch.Tensor = rsrc, root: int = root,
                        op: str = op) -> torch.Tensor:
                    t = rsrc.clone()
                    dist.reduce(t, dst=root, op=TORCH_OPS[op], group=g)
                    return t

                mine, theirs = _both(w, red)
                if w.rank == root:
                    same(mine, _ref(dtype, count, w.size, op, seed=root), "reduce " + what)
                else:
                    same(mine, rsrc, "reduce leaves non-root buffers unchanged " + what)
                if isinstance(theirs, torch.Tensor) and w.rank == root:
                    same(mine, theirs, "reduce vs gloo " + what)

                def gath(g: Any, src: torch.Tensor = src, root: int = root) -> list[Any]:
                    outs = ([torch.full_like(src, 7) for _ in range(w.size)]
                            if w.rank == root else None)
                    dist.gather(src, outs, dst=root, group=g)
                    return outs or []

                mine_l, theirs_l = _both(w, gath)
                for r, (a, b) in enumerate(zip(mine_l, theirs_l, strict=True)):
                    same(a, b, f"gather part {r} " + what)

                def scat(g: Any, count: int = count, root: int = root,
                         dtype: str = dtype) -> torch.Tensor:
                    parts = ([data(dtype, count, root, seed=100 + r) for r in range(w.size)]
                             if w.rank == root else None)
                    out = torch.zeros(count, dtype=TORCH_DTYPES[dtype])
                    dist.scatter(out, parts, src=root, group=g)
                    return out

                mine, theirs = _both(w, scat)
                same(mine, theirs, "scatter " + what)
                same(mine, data(dtype, count, root, seed=100 + w.rank), "scatter exact " + what)


# -- all_gather ----------------------------------------------------------------------------

def case_all_gather(w: World) -> None:
    for dtype in ("float32", "float16", "int32", "bool"):
        for count in COUNTS:
            what = f"{dtype} count={count}"
            src = data(dtype, count, w.rank)

            def ag_list(g: Any, src: torch.Tensor = src) -> list[torch.Tensor]:
                outs = [torch.zeros_like(src) for _ in range(w.size)]
                dist.all_gather(outs, src, group=g)
                return outs

            mine, theirs = _both(w, ag_list)
            for r in range(w.size):
                same(mine[r], theirs[r], f"all_gather part {r} " + what)
                same(mine[r], data(dtype, count, r), f"all_gather exact {r} " + what)

            def ag_tensor(g: Any, src: torch.Tensor = src) -> torch.Tensor:
                out = torch.zeros(w.size * src.numel(), dtype=src.dtype)
                dist.all_gather_single(out, src, group=g)
                return out

            mine_t, theirs_t = _both(w, ag_tensor)
            same(mine_t, theirs_t, "all_gather_single " + what)
    # 2-D tensors, and the old names C++ and older callers use
    src = data("float64", 12, w.rank).reshape(3, 4)
    out = torch.zeros(3 * w.size, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, src)
    same(out, torch.cat([data("float64", 12, r).reshape(3, 4) for r in range(w.size)]),
         "all_gather_into_tensor 2-D")
    out2 = torch.zeros_like(out)
    dist.group.WORLD._allgather_base(out2, src).wait()
    same(out2, out, "_allgather_base")
    # uneven all_gather (allgatherv): gloo has no answer, numpy does
    counts = [(r * 3) % 5 for r in range(w.size)]  # rank 0 sends nothing
    mine_src = data("int64", counts[w.rank], w.rank)
    outs = [torch.zeros(c, dtype=torch.int64) for c in counts]
    dist.all_gather(outs, mine_src)
    for r in range(w.size):
        same(outs[r], data("int64", counts[r], r), f"uneven all_gather part {r}")


def case_all_gather_coalesced(w: World) -> None:
    ins = [data("float32", n, w.rank, seed=n) for n in (1, 0, 7, 5)]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(w.size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outs, ins)
    for r in range(w.size):
        for k, n in enumerate((1, 0, 7, 5)):
            same(outs[r][k], data("float32", n, r, seed=n), f"all_gather_coalesced [{r}][{k}]")


# -- reduce_scatter ------------------------------------------------------------------------

def case_reduce_scatter(w: World) -> None:
    for dtype in ("float32", "bfloat16", "int64"):
        for op in ("sum", "max", "min"):
            for count in (0, 1, 7, BIG_COUNT // 4):
                what = f"{dtype} {op} count={count}"
                src = data(dtype, count * w.size, w.rank, op=op)

                def rs_list(g: Any, src: torch.Tensor = src, count: int = count,
                            op: str = op) -> torch.Tensor:
                    out = torch.zeros(count, dtype=src.dtype)
                    dist.reduce_scatter(out, list(src.split(count) if count else
                                                  [src[:0]] * w.size),
                                        op=TORCH_OPS[op], group=g)
                    return out

                def rs_tensor(g: Any, src: torch.Tensor = src, count: int = count,
                              op: str = op) -> torch.Tensor:
                    out = torch.zeros(count, dtype=src.dtype)
                    dist.reduce_scatter_single(out, src.clone(), op=TORCH_OPS[op], group=g)
                    return out

                full = _ref(dtype, count * w.size, w.size, op)
                expect = full[count * w.rank:count * (w.rank + 1)]
                for name, fn in (("reduce_scatter", rs_list),
                                 ("reduce_scatter_tensor", rs_tensor)):
                    mine, theirs = _both(w, fn)
                    same(mine, expect, f"{name} {what}")
                    if isinstance(theirs, torch.Tensor):
                        same(mine, theirs, f"{name} vs gloo {what}")
    # AVG (what FSDP2 uses), uneven input list, the old name
    src = data("float32", 5 * w.size, w.rank, op="avg")
    out = torch.zeros(5)
    dist.reduce_scatter_single(out, src, op=RO.AVG)
    full = _ref("float32", 5 * w.size, w.size, "avg")
    same(out, full[5 * w.rank:5 * w.rank + 5], "reduce_scatter_tensor AVG")
    sizes = [r + 1 for r in range(w.size)]
    parts = [data("int32", n, w.rank, op="sum", seed=i) for i, n in enumerate(sizes)]
    out = torch.zeros(sizes[w.rank], dtype=torch.int32)
    dist.reduce_scatter(out, parts)
    expect = _ref("int32", sizes[w.rank], w.size, "sum", seed=w.rank)
    same(out, expect, "uneven reduce_scatter")
    out2 = torch.zeros(5)
    dist.group.WORLD._reduce_scatter_base(out2, src.clone(), dist.ReduceScatterOptions()).wait()
    same(out2, _ref("float32", 5 * w.size, w.size, "avg")[5 * w.rank:5 * w.rank + 5] * w.size,
         "_reduce_scatter_base (SUM)")


# -- all_to_all ----------------------------------------------------------------------------

def _splits(size: int, rank: int) -> tuple[list[int], list[int]]:
    """Uneven row splits with zeros: rank s sends (s + d) % 3 rows to rank d."""
    send = [(rank + d) % 3 for d in range(size)]
    recv = [(s + rank) % 3 for s in range(size)]
    return send, recv


def case_all_to_all(w: World) -> None:
    for dtype in ("float32", "int16", "bfloat16"):
        # equal splits
        src = data(dtype, 4 * w.size, w.rank)

        def a2a_equal(g: Any, src: torch.Tensor = src) -> torch.Tensor:
            out = torch.zeros_like(src)
            dist.all_to_all_single(out, src, group=g)
            return out

        mine, theirs = _both(w, a2a_equal)
        _vs_gloo(mine, theirs, f"all_to_all_single equal {dtype}")
        same(mine, torch.cat([data(dtype, 4 * w.size, s)[4 * w.rank:4 * w.rank + 4]
                              for s in range(w.size)]), f"all_to_all_single equal {dtype}")
        # uneven splits with zeros, 2-D rows
        send, recv = _splits(w.size, w.rank)
        rows = data(dtype, sum(send) * 3, w.rank, seed=1).reshape(-1, 3)

        def a2a_uneven(g: Any, rows: torch.Tensor = rows, send: list[int] = send,
                       recv: list[int] = recv) -> torch.Tensor:
            out = torch.zeros(sum(recv), 3, dtype=rows.dtype)
            dist.all_to_all_single(out, rows, output_split_sizes=recv,
                                   input_split_sizes=send, group=g)
            return out

        mine, theirs = _both(w, a2a_uneven)
        _vs_gloo(mine, theirs, f"all_to_all_single uneven {dtype}")
        expect = []
        for s in range(w.size):
            s_send, _ = _splits(w.size, s)
            s_rows = data(dtype, sum(s_send) * 3, s, seed=1).reshape(-1, 3)
            off = sum(s_send[:w.rank])
            expect.append(s_rows[off:off + s_send[w.rank]])
        same(mine, torch.cat(expect), f"all_to_all_single uneven exact {dtype}")
    # list form with a different size per pair
    ins = [data("int32", w.rank + d, w.rank, seed=d) for d in range(w.size)]

    def a2a_list(g: Any) -> list[torch.Tensor]:
        outs = [torch.zeros(s + w.rank, dtype=torch.int32) for s in range(w.size)]
        dist.all_to_all(outs, ins, group=g)
        return outs

    mine_l, theirs_l = _both(w, a2a_list)
    for s in range(w.size):
        same(mine_l[s], data("int32", s + w.rank, s, seed=w.rank), f"all_to_all from {s}")
        if not isinstance(theirs_l, BaseException):  # gloo has no list all_to_all
            same(mine_l[s], theirs_l[s], f"all_to_all vs gloo from {s}")
    # the old name C++ callers reach
    out = torch.zeros(4 * w.size)
    src = data("float32", 4 * w.size, w.rank)
    dist.group.WORLD.alltoall_base(out, src, [], [], dist.AllToAllOptions()).wait()
    expect_t = torch.zeros_like(out)
    dist.all_to_all_single(expect_t, src, group=w.gloo)
    same(out, expect_t, "alltoall_base")


# -- coalesced operations, the coalescing manager, barrier --------------------------------------

def case_coalesced(w: World) -> None:
    ts = [data("float32", n, w.rank, op="sum", seed=n) for n in (3, 0, 1, BIG_COUNT)]
    mine = [t.clone() for t in ts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(mine)
        theirs = [t.clone() for t in ts]
        dist.all_reduce_coalesced(theirs, group=w.gloo)
    for k, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        same(a, b, f"all_reduce_coalesced [{k}]")
    # mixed dtypes: one allreduce each
    mixed = [data("float64", 5, w.rank, op="sum"), data("int8", 4, w.rank, op="sum")]
    dist.group.WORLD.allreduce_coalesced(mixed, dist.AllreduceCoalescedOptions()).wait()
    same(mixed[0], _ref("float64", 5, w.size, "sum"), "mixed coalesced float64")
    same(mixed[1], _ref("int8", 4, w.size, "sum"), "mixed coalesced int8")
    # the coalescing manager, with and without a device, sync and async
    for device in (torch.device("cpu"), None):
        for async_ops in (False, True):
            ar = [data("float32", n, w.rank, op="sum", seed=n) for n in (2, 9)]
            ag_in = [data("int64", n, w.rank, seed=n) for n in (3, 1)]
            ag_out = [torch.zeros(w.size * t.numel(), dtype=torch.int64) for t in ag_in]
            rs_in = [data("float32", w.size * n, w.rank, op="sum", seed=n) for n in (2, 3)]
            rs_out = [torch.zeros(n) for n in (2, 3)]
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for t in ar:
                    dist.all_reduce(t)
            if async_ops:
                cm.wait()
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for o, i in zip(ag_out, ag_in, strict=True):
                    dist.all_gather_single(o, i)
            if async_ops:
                cm.wait()
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for o, i in zip(rs_out, rs_in, strict=True):
                    dist.reduce_scatter_single(o, i)
            if async_ops:
                cm.wait()
            tag = f"coalescing manager device={device} async={async_ops}"
            for t, n in zip(ar, (2, 9), strict=True):
                same(t, _ref("float32", n, w.size, "sum", seed=n), f"{tag} all_reduce {n}")
            for o, n in zip(ag_out, (3, 1), strict=True):
                same(o, torch.cat([data("int64", n, r, seed=n) for r in range(w.size)]),
                     f"{tag} all_gather {n}")
            for o, n in zip(rs_out, (2, 3), strict=True):
                full = _ref("float32", w.size * n, w.size, "sum", seed=n)
                same(o, full[n * w.rank:n * (w.rank + 1)], f"{tag} reduce_scatter {n}")
    # barrier, sync and async
    dist.barrier()
    dist.barrier(async_op=True).wait()


# -- async_op=True: every operation returns a Work; its future holds the tensors --------------

def case_async(w: World) -> None:
    t = data("float32", 7, w.rank, op="sum")
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert work.exception() is None
    same(t, _ref("float32", 7, w.size, "sum"), "async all_reduce")
    fut = dist.all_reduce(t, async_op=True).get_future()
    value = fut.wait()
    assert isinstance(value, list) and value[0] is t, value
    same(t, _ref("float32", 7, w.size, "sum") * w.size, "async all_reduce twice")
    # several in flight at once, completing in issue order
    ts = [data("int64", 5, w.rank, op="sum", seed=k) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    outs = [torch.zeros(w.size * 5, dtype=torch.int64) for _ in range(3)]
    works += [dist.all_gather_single(o, data("int64", 5, w.rank, seed=50 + k), async_op=True)
              for k, o in enumerate(outs)]
    b = data("float64", 9, w.rank, seed=3)
    works.append(dist.broadcast(b, src=w.size - 1, async_op=True))
    lst = [torch.zeros(5, dtype=torch.int64) for _ in range(w.size)]
    works.append(dist.all_gather(lst, data("int64", 5, w.rank, seed=60), async_op=True))
    a2a = torch.zeros(2 * w.size)
    works.append(dist.all_to_all_single(a2a, data("float32", 2 * w.size, w.rank),
                                        async_op=True))
    rs = torch.zeros(2)
    works.append(dist.reduce_scatter_single(rs, data("float32", 2 * w.size, w.rank, op="sum"),
                                            async_op=True))
    works.append(dist.barrier(async_op=True))
    for x in reversed(works):
        x.wait()
    for k in range(6):
        same(ts[k], _ref("int64", 5, w.size, "sum", seed=k), f"async in flight {k}")
    for k, o in enumerate(outs):
        same(o, torch.cat([data("int64", 5, r, seed=50 + k) for r in range(w.size)]),
             f"async all_gather_single {k}")
    same(b, data("float64", 9, w.size - 1, seed=3), "async broadcast")
    for r in range(w.size):
        same(lst[r], data("int64", 5, r, seed=60), f"async all_gather list {r}")
    full = _ref("float32", 2 * w.size, w.size, "sum")
    same(rs, full[2 * w.rank:2 * w.rank + 2], "async reduce_scatter_single")
    # the value of get_future() of list outputs is the list of output tensors
    o = [torch.zeros(3) for _ in range(w.size)]
    value = dist.all_gather(o, data("float32", 3, w.rank), async_op=True).get_future().wait()
    assert len(value) == w.size and all(v is x for v, x in zip(value, o, strict=True))


# -- point to point -----------------------------------------------------------------------------

def case_p2p(w: World) -> None:
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    for count in (1, 7, BIG_COUNT):
        src = data("float32", count, w.rank, seed=count)
        got = torch.zeros(count)
        if w.rank % 2 == 0:
            dist.send(src, right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(src, right)
        same(got, data("float32", count, left, seed=count), f"send/recv ring count={count}")
    # isend/irecv with tags, received out of tag order
    sends = [dist.isend(data("int64", 3, w.rank, seed=tag), right, tag=tag) for tag in (5, 9)]
    got9, got5 = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    r9 = dist.irecv(got9, left, tag=9)
    r5 = dist.irecv(got5, left, tag=5)
    for x in [*sends, r9, r5]:
        x.wait()
    same(got9, data("int64", 3, left, seed=9), "irecv tag 9")
    same(got5, data("int64", 3, left, seed=5), "irecv tag 5")
    # batch_isend_irecv with the receive listed first (must not block the send)
    got = torch.zeros(4, dtype=torch.float64)
    ops = [dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.isend,
                                                       data("float64", 4, w.rank), right)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    same(got, data("float64", 4, left), "batch_isend_irecv recv first")
    # recv from any source: rank 0 collects one message from every other rank
    if w.rank == 0:
        seen = set()
        for _ in range(w.size - 1):
            t = torch.zeros(2, dtype=torch.int32)
            src = dist.recv(t)
            same(t, data("int32", 2, src, seed=1), f"recv any source from {src}")
            seen.add(src)
        assert seen == set(range(1, w.size)), seen
        t = torch.zeros(1)
        work = dist.irecv(t, tag=7)  # any source, async
        work.wait()
        assert work._source_rank() == w.size - 1
    else:
        dist.send(data("int32", 2, w.rank, seed=1), 0)
        if w.rank == w.size - 1:
            dist.send(torch.ones(1), 0, tag=7)
    dist.barrier()


def case_p2p_first(w: World) -> None:
    """Send/recv as the very first operation of a new group, others busy elsewhere."""
    g = dist.new_group(backend="plait")
    if w.rank == 0:
        dist.send(data("float32", 5, 0), 1, group=g)
    elif w.rank == 1:
        t = torch.zeros(5)
        dist.recv(t, 0, group=g)
        same(t, data("float32", 5, 0), "first-op recv")
    else:
        time.sleep(0.3)  # the other ranks do something else meanwhile
    dist.barrier(group=g)
    dist.destroy_process_group(g)


# -- groups ---------------------------------------------------------------------------------

def case_subgroups(w: World) -> None:
    """new_group subgroups are separate plait communicators running concurrently."""
    evens = [r for r in range(w.size) if r % 2 == 0]
    odds = [r for r in range(w.size) if r % 2 == 1]
    ge = dist.new_group(evens, backend="plait")
    go = dist.new_group(odds, backend="plait")
    mine = ge if w.rank % 2 == 0 else go
    members = evens if w.rank % 2 == 0 else odds
    t = data("int64", 6, w.rank, op="sum")
    dist.all_reduce(t, group=mine)
    expect = sum(data("int64", 6, r, op="sum") for r in members)
    same(t, expect, "subgroup all_reduce")
    assert dist.get_backend(mine) == "plait"
    assert dist.get_world_size(mine) == len(members)
    # two full-size groups driven at the same time from two threads of every rank
    g1 = dist.new_group(backend="plait")
    g2 = dist.new_group(backend="plait")
    errors: list[BaseException] = []
    results: dict[int, list[torch.Tensor]] = {1: [], 2: []}

    def drive(g: Any, which: int) -> None:
        try:
            for k in range(30):
                x = data("float32", 7, w.rank, op="sum", seed=which * 100 + k)
                dist.all_reduce(x, group=g)
                results[which].append(x)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(g1, 1)),
               threading.Thread(target=drive, args=(g2, 2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    for which in (1, 2):
        for k, x in enumerate(results[which]):
            same(x, _ref("float32", 7, w.size, "sum", seed=which * 100 + k),
                 f"concurrent group {which} op {k}")
    for g in (ge, go, g1, g2):
        dist.destroy_process_group(g)


# -- test functions ---------------------------------------------------------------------------

def test_all_reduce_every_dtype_and_op(world: Any) -> None:
    for compared in world.run(case_all_reduce):
        assert compared["numpy"] > 200
        assert compared["gloo"] > 100, compared  # most pairs are gloo's too


def test_all_reduce_avg_and_premul_sum(world: Any) -> None:
    world.run(case_all_reduce_avg_premul)


def test_broadcast_reduce_gather_scatter(world: Any) -> None:
    world.run(case_rooted)


def test_all_gather(world: Any) -> None:
    world.run(case_all_gather)


def test_all_gather_coalesced(world: Any) -> None:
    world.run(case_all_gather_coalesced)


def test_reduce_scatter(world: Any) -> None:
    world.run(case_reduce_scatter)


def test_all_to_all(world: Any) -> None:
    world.run(case_all_to_all)


def test_coalesced_and_barrier(world: Any) -> None:
    world.run(case_coalesced)


def test_async_ops(world: Any) -> None:
    world.run(case_async)


def test_point_to_point(world: Any) -> None:
    world.run(case_p2p)


def test_send_recv_as_first_op(world: Any) -> None:
    world.run(case_p2p_first)


def test_subgroups_concurrent(world: Any) -> None:
    world.run(case_subgroups)
