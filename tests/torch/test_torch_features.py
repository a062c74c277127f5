"""What C++ callers, the profiler and debugging see of the plait backend.

Functional collectives and DTensor (C++ callers of the group), errors through
``Work.wait()`` and ``get_future()``, ``PLAIT_DEBUG=check``, and profiler ranges named
``plait::<op>`` for synchronous and asynchronous calls.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from plait_torch_world import World, data, same

import plait

SIZES = (2, 3)


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, worlds: Any) -> Any:
    return worlds.get(request.param)


def _sum(dtype: str, count: int, size: int, seed: int = 0) -> torch.Tensor:
    return sum((data(dtype, count, r, op="sum", seed=seed) for r in range(size)),
               start=torch.zeros(count, dtype=data(dtype, 0, 0).dtype))


# -- functional collectives and DTensor ------------------------------------------------------

def case_functional(w: World) -> None:
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    t = data("float32", 6, w.rank, op="sum")
    out = funcol.all_reduce(t, "sum", group)
    same(funcol.wait_tensor(out), _sum("float32", 6, w.size), "funcol all_reduce")
    g = funcol.all_gather_tensor(data("float32", 4, w.rank), 0, group)
    same(funcol.wait_tensor(g), torch.cat([data("float32", 4, r) for r in range(w.size)]),
         "funcol all_gather_tensor")
    x = data("float32", 3 * w.size, w.rank, op="sum")
    rs = funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))
    same(rs, _sum("float32", 3 * w.size, w.size)[3 * w.rank:3 * w.rank + 3],
         "funcol reduce_scatter_tensor")
    a = data("int64", 2 * w.size, w.rank)
    a2a = funcol.wait_tensor(funcol.all_to_all_single(a, None, None, group))
    same(a2a, torch.cat([data("int64", 2 * w.size, s)[2 * w.rank:2 * w.rank + 2]
                         for s in range(w.size)]), "funcol all_to_all_single")
    b = funcol.wait_tensor(funcol.broadcast(data("float64", 5, w.rank), 0, group))
    same(b, data("float64", 5, 0), "funcol broadcast")
    # the _c10d_functional ops straight, as compiled code calls them
    name = group.group_name
    y = torch.ops._c10d_functional.all_reduce(data("float32", 6, w.rank, op="sum"), "avg", name)
    same(torch.ops._c10d_functional.wait_tensor(y), _sum("float32", 6, w.size) / w.size,
         "_c10d_functional.all_reduce avg")


def case_dtensor(w: World) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (w.size,))
    full = torch.arange(4 * w.size * 3, dtype=torch.float32).reshape(4 * w.size, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    same(sharded.to_local(), full[4 * w.rank:4 * w.rank + 4], "Shard(0) local part")
    same(sharded.redistribute(mesh, [Replicate()]).to_local(), full, "Shard -> Replicate")
    col = distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
    same(col.full_tensor(), full, "Replicate -> Shard(1) -> full")
    from torch.distributed.tensor import DTensor

    part = DTensor.from_local(data("float32", 6, w.rank, op="sum"), mesh, [Partial()])
    same(part.redistribute(mesh, [Replicate()]).to_local(), _sum("float32", 6, w.size),
         "Partial -> Replicate")
    # a matmul with sharded weights: DTensor picks the collectives
    weight = distribute_tensor(torch.eye(3) * 2, mesh, [Replicate()])
    prod = (sharded @ weight).full_tensor()
    same(prod, full @ (torch.eye(3) * 2), "sharded matmul")


# -- errors ------------------------------------------------------------------------------------

def case_errors(w: World) -> None:
    """A failing operation raises plait's error through every path of its Work."""
    g = dist.new_group(backend="plait", timeout=datetime.timedelta(seconds=1))
    if w.rank == 0:  # the others never join: the operation times out
        t = torch.ones(4)
        work = dist.all_reduce(t, group=g, async_op=True)
        with pytest.raises(plait.CommTimeoutError, match="rank 0"):
            work.wait()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), plait.CommTimeoutError)
        with pytest.raises(Exception, match="rank 0"):  # C++ future: error, not a value
            work.get_future().wait()
        # the communicator is unusable afterwards: later calls raise at once
        with pytest.raises(plait.PlaitError):
            dist.all_reduce(t, group=g)
    dist.barrier()
    # a failing synchronous call raises directly; a wait(timeout) that expires raises
    # CommTimeoutError while the operation keeps running
    if w.rank == 0:
        t = torch.zeros(2)
        work = dist.irecv(t, 1, tag=3)
        with pytest.raises(plait.CommTimeoutError):
            work.wait(datetime.timedelta(milliseconds=100))
        dist.barrier()
        work.wait()
        same(t, torch.full((2,), 3.0), "recv after an expired wait")
    else:
        dist.barrier()
        if w.rank == 1:
            dist.send(torch.full((2,), 3.0), 0, tag=3)
    dist.barrier()
    dist.destroy_process_group(g)
    # C++ callers: a functional collective on a group whose communicator failed raises
    g2 = dist.new_group(backend="plait", timeout=datetime.timedelta(seconds=1))
    if w.rank == 0:
        import torch.distributed._functional_collectives as funcol

        with pytest.raises(Exception, match="rank 0"):
            funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", g2))
    dist.barrier()
    dist.destroy_process_group(g2)


def case_debug_check(w: World) -> None:
    os.environ["PLAIT_DEBUG"] = "check"  # read when the group's communicator is made
    try:
        g = dist.new_group(backend="plait")
    finally:
        del os.environ["PLAIT_DEBUG"]
    t = data("float32", 4 + (w.rank == 1), w.rank)
    with pytest.raises(plait.MismatchError) as info:
        dist.all_reduce(t, group=g)
    msg = str(info.value)
    assert f"rank {w.rank}, PLAIT_DEBUG=check" in msg, msg
    assert "rank 0: allreduce dtype=float32 count=4 root=- reduce_op=SUM" in msg, msg
    assert "rank 1: allreduce dtype=float32 count=5 root=- reduce_op=SUM" in msg, msg
    # different operations and roots
    x = torch.zeros(3)
    with pytest.raises(plait.MismatchError) as info:
        if w.rank == 0:
            dist.broadcast(x, src=0, group=g)
        else:
            dist.reduce(x, dst=w.rank, group=g)
    assert "rank 0: broadcast dtype=float32 count=3 root=0" in str(info.value)
    assert "rank 1: reduce dtype=float32 count=3 root=1" in str(info.value)
    # matching calls pass, uneven ones are not flagged
    dist.all_reduce(torch.ones(3), group=g)
    outs = [torch.zeros(r) for r in range(w.size)]
    dist.all_gather(outs, torch.ones(w.rank), group=g)
    dist.destroy_process_group(g)


# -- profiler ----------------------------------------------------------------------------------

def case_profiler(w: World) -> dict[str, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    def ops() -> None:
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, src=0)
        dist.all_gather_single(torch.zeros(8 * w.size), t, async_op=True).wait()
        dist.barrier()
        if w.rank == 0:
            dist.send(t, 1)
        elif w.rank == 1:
            dist.recv(t, 0)

    found: dict[str, list[str]] = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ops()
    found["torch.profiler"] = sorted({e.name for e in prof.events()
                                      if e.name.startswith("plait::")})
    with torch.autograd.profiler.profile() as aprof:
        ops()
    found["autograd"] = sorted({e.name for e in aprof.function_events
                                if e.name.startswith("plait::")})
    dist.barrier()
    return found


# -- test functions ------------------------------------------------------------------------------

def test_functional_collectives(world: Any) -> None:
    world.run(case_functional)


def test_dtensor_redistribute(world: Any) -> None:
    world.run(case_dtensor)


def test_errors_through_work(world: Any) -> None:
    world.run(case_errors)


def test_debug_check_mismatch(world: Any) -> None:
    world.run(case_debug_check)


def test_profiler_names(world: Any) -> None:
    for rank, found in enumerate(world.run(case_profiler)):
        for kind, names in found.items():
            want = {"plait::allreduce", "plait::broadcast", "plait::all_gather_into_tensor",
                    "plait::barrier"}
            if rank < 2:
                want.add("plait::send" if rank == 0 else "plait::recv")
            assert want <= set(names), (rank, kind, names)
