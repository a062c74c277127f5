"""Failures through torch.distributed: a killed rank stops DDP with an error (no hang),
and torch's abort of a process group unblocks the other ranks."""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import threading
import time
from typing import Any

import plait_torch_world as ptw
import torch
import torch.distributed as dist

_keys = itertools.count()


def _run_fresh(world: Any, fn: Any, *args: Any, may_die: list[int]) -> list[Any]:
    """TorchWorld.run_fresh, allowing ranks to die."""
    world._key = ""
    world._worlds.active = None
    key = f"plait-torch-rel/{os.getpid()}/{next(_keys)}/"
    target = f"{fn.__module__}:{fn.__qualname__}"
    return world.pool.run(ptw.fresh_case, world.addr, key, target, args, {},  # type: ignore[no-any-return]
                          deadline=90, may_die=may_die)


def _init(info: Any, addr: Any, key: str) -> None:
    dist.init_process_group("plait", store=ptw._store(addr, key), rank=info.rank,
                            world_size=info.size, timeout=datetime.timedelta(seconds=30))


def case_ddp_killed_rank(info: Any, addr: Any, key: str, victim: int) -> dict[str, Any] | None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(info, addr, key)
    torch.manual_seed(info.rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    last_ok = time.monotonic()
    res: dict[str, Any] | None = None
    try:
        for step in range(100_000):
            if info.rank == victim and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            last_ok = time.monotonic()
    except Exception as exc:  # DDP may wrap plait's error in a RuntimeError
        res = {"type": type(exc).__name__, "msg": str(exc),
               "elapsed": time.monotonic() - last_ok}
    finally:
        dist.destroy_process_group()
    return res


def test_ddp_step_with_a_killed_rank_raises(worlds: Any) -> None:
    results = _run_fresh(worlds.get(3), case_ddp_killed_rank, 1, may_die=[1])
    for r in (0, 2):
        res = results[r]
        assert res is not None, f"rank {r}: training went on without rank 1"
        assert "rank 1" in res["msg"], res
        assert res["elapsed"] < 10, res


def _net() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def case_ddp_shrink(info: Any, addr: Any, key: str, victim: int) -> dict[str, Any] | None:
    """DDP on 3 ranks; ``victim`` is SIGKILLed at step 3; the survivors shrink the world,
    rebuild DDP on the new group from their in-memory model and take a step whose
    gradients are checked exactly against the average computed locally."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import plait.torch

    _init(info, addr, key)
    net = _net()
    model = DDP(net, bucket_cap_mb=0.004)
    t_fail = None
    try:
        for step in range(100_000):
            if info.rank == victim and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            model.zero_grad()
            model(_batch(step, info.rank)).sum().backward()
    except Exception:  # DDP may wrap plait's error in a RuntimeError
        t_fail = time.monotonic()
    assert t_fail is not None
    group = plait.torch.shrink()
    res = group.shrink_result
    assert res is not None
    t_group = time.monotonic()
    survivors = [r for r in range(info.size) if r != victim]
    assert dist.get_world_size(group) == len(survivors)
    assert dist.get_rank(group) == survivors.index(info.rank)
    assert dist.get_process_group_ranks(group) == survivors
    model = DDP(net, process_group=group, bucket_cap_mb=0.004)
    model.zero_grad()
    model(_batch(99, info.rank)).sum().backward()
    t_step = time.monotonic()
    # the reference: every survivor's gradient, each divided by the group size, summed
    ref = [torch.zeros_like(p) for p in net.parameters()]
    for r in survivors:
        local = _net()
        local.load_state_dict(net.state_dict())
        local(_batch(99, r)).sum().backward()
        for acc, p in zip(ref, local.parameters(), strict=True):
            acc += p.grad / len(survivors)
    for i, (p, want) in enumerate(zip(net.parameters(), ref, strict=True)):
        ptw.same(p.grad, want, f"gradient {i} after the shrink")
    dist.destroy_process_group()
    return {"ranks": res.ranks, "lost": res.lost, "shrink_s": t_group - t_fail,
            "step_s": t_step - t_group}


def test_ddp_continues_on_a_shrunk_group(worlds: Any) -> None:
    results = _run_fresh(worlds.get(3), case_ddp_shrink, 1, may_die=[1])
    for r in (0, 2):
        res = results[r]
        assert res["ranks"] == (0, 2) and res["lost"] == (1,), res
        assert res["shrink_s"] < 2.0, res


def case_torch_abort(info: Any, addr: Any, key: str) -> dict[str, Any]:
    """Rank 1 aborts its process group (torch's _abort_process_group) while ranks 0 and
    2 wait for it in an all_reduce, and while its own async receive is pending."""
    _init(info, addr, key)
    t = torch.ones(1000)
    dist.all_reduce(t)
    t0 = time.monotonic()
    if info.rank == 1:
        work = dist.irecv(torch.empty(4), src=0, tag=7)
        timer = threading.Timer(0.5, dist.distributed_c10d._abort_process_group)
        timer.start()
        try:
            work.wait()
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        else:
            err = ""
        timer.join()
        return {"err": err, "elapsed": time.monotonic() - t0}
    try:
        dist.all_reduce(t)
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    else:
        err = ""
    dist.destroy_process_group()
    return {"err": err, "elapsed": time.monotonic() - t0}


def test_torch_abort_unblocks_every_rank(worlds: Any) -> None:
    results = _run_fresh(worlds.get(3), case_torch_abort, may_die=[])
    assert "ClosedError" in results[1]["err"], results
    for r in (0, 2):
        assert "PeerFailedError" in results[r]["err"] and "rank 1" in results[r]["err"], results
    assert all(res["elapsed"] < 10 for res in results), results
