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
