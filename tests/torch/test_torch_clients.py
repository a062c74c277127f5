"""torch clients that ask the group which devices it serves, and torchrun restarts.

DCP ``async_save``, ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``broadcast_from_rank0`` on FSDP2, and DCP of FSDP1 models read ``pg._device_types``; a
Python group answered none until plait's answered ``cpu``. Each case runs twice in the same
rank processes, on plait (the default group) and on a gloo group over the same ranks, and
checks the restored state bitwise against the saved one, and plait's results bitwise
against gloo's (2 ranks: a sum of two numbers does not depend on the order).

The restart case runs torchrun itself: rank 1 exits before any init on the first attempt
and both ranks must meet on the second (the restart count is part of plait's store keys).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from plait_torch_world import World, same

from plait.rendezvous import key_prefix, restart_attempt
from plait.testing.harness import clean_environ, free_port

SIZE = 2
# The cases return no tensors: the harness pickles results, and torch's pickling of a
# tensor between processes goes through shared memory and an authenticated side channel.


@pytest.fixture(scope="module")
def world(worlds: Any) -> Any:
    return worlds.get(SIZE)


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> float:
    x, y = _batch(rank)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.item())


def _local(t: Any) -> torch.Tensor:
    """This rank's part of a tensor, DTensor or ShardedTensor, detached."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    elif hasattr(t, "local_tensor"):
        t = t.local_tensor()
    return t.detach().clone()  # type: ignore[no-any-return]


def _flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by dotted key, as this rank's local part."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(_flat(v, f"{prefix}{i}."))
    elif isinstance(state, torch.Tensor):
        out[prefix.rstrip(".")] = _local(state)
    return out


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    assert a, f"{what}: no tensors"
    for k in a:
        same(a[k], b[k], f"{what} {k}")


def _groups(w: World) -> list[tuple[str, Any]]:
    return [("plait", None), ("gloo", w.gloo)]


# -- which devices the group serves --------------------------------------------------------

def case_devices(w: World) -> list[str]:
    pg = dist.group.WORLD
    assert dist.get_backend(pg) == "plait"
    return [str(d) for d in pg._device_types]


def test_group_serves_cpu(world: Any) -> None:
    # gloo answers cpu and cuda; plait moves CPU tensors only (see backend.DEVICES)
    assert world.run(case_devices) == [["cpu"]] * SIZE


# -- DCP async_save --------------------------------------------------------------------------

def case_dcp_async_save(w: World, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for name, group in _groups(w):
        mesh = (init_device_mesh("cpu", (w.size,)) if group is None
                else DeviceMesh.from_group(group, "cpu"))
        model = _mlp(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _step(model, opt, 0)  # the same step on every rank: a replicated model
        model_sd, optim_sd = get_state_dict(model, opt)
        # a sharded tensor too: every rank writes its own part
        full = torch.arange(6 * w.size, dtype=torch.float64).reshape(2 * w.size, 3) / 7
        state = {"model": model_sd, "optim": optim_sd,
                 "sharded": distribute_tensor(full, mesh, [Shard(0)])}
        saved = _flat(state)
        future = dcp.async_save(state, checkpoint_id=f"{path}/{name}", process_group=group)
        future.result()
        # restore into a model that differs in every value, optimizer state included
        model2 = _mlp(1)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
        _step(model2, opt2, 1)
        model_sd2, optim_sd2 = get_state_dict(model2, opt2)
        target = {"model": model_sd2, "optim": optim_sd2,
                  "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        dcp.load(target, checkpoint_id=f"{path}/{name}", process_group=group)
        set_state_dict(model2, opt2, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        model_sd3, optim_sd3 = get_state_dict(model2, opt2)
        restored = _flat({"model": model_sd3, "optim": optim_sd3, "sharded": target["sharded"]})
        _same_state(saved, restored, f"{name}: async_save + load")
        loaded[name] = restored
    _same_state(loaded["plait"], loaded["gloo"], "plait vs gloo")


def test_dcp_async_save_and_load(world: Any, tmp_path: Path) -> None:
    world.run(case_dcp_async_save, str(tmp_path))


# -- FSDP2: full state dicts broadcast from rank 0 -------------------------------------------

def case_fsdp2_broadcast_from_rank0(w: World) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _mlp(seed)  # FSDP2 does not broadcast: the same seed on every rank
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    results: dict[str, Any] = {}
    for name, group in _groups(w):
        mesh = (init_device_mesh("cpu", (w.size,)) if group is None
                else DeviceMesh.from_group(group, "cpu"))
        src, src_opt = sharded(0, mesh)
        for _ in range(2):
            _step(src, src_opt, w.rank)
        # full state on rank 0 only (cpu_offload: the other ranks get {})
        gather = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(src, options=gather)
        osd = get_optimizer_state_dict(src, src_opt, options=gather)
        assert bool(msd) == (w.rank == 0) and bool(osd) == (w.rank == 0), name
        dst, dst_opt = sharded(1, mesh)
        _step(dst, dst_opt, w.rank)  # optimizer state to overwrite
        bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(dst, msd if w.rank == 0 else {}, options=bcast)
        set_optimizer_state_dict(dst, dst_opt, osd if w.rank == 0 else {}, options=bcast)
        # every rank's shards of parameters and optimizer state are the source's
        _same_state(_flat(src.state_dict()), _flat(dst.state_dict()), f"{name}: parameters")
        _same_state(_flat(src_opt.state_dict()["state"]), _flat(dst_opt.state_dict()["state"]),
                    f"{name}: optimizer state")
        # and training goes on identically
        losses = [_step(src, src_opt, w.rank), _step(dst, dst_opt, w.rank)]
        assert losses[0] == losses[1], (name, losses)
        results[name] = {"loss": losses[0], "params": _flat(dst.state_dict())}
    assert results["plait"]["loss"] == results["gloo"]["loss"], results
    _same_state(results["plait"]["params"], results["gloo"]["params"], "plait vs gloo")
    return {k: v["loss"] for k, v in results.items()}


def test_fsdp2_set_state_dicts_broadcast_from_rank0(world: Any) -> None:
    world.run(case_fsdp2_broadcast_from_rank0)


# -- DCP of an FSDP1 model ---------------------------------------------------------------------

def case_fsdp1_dcp(w: World, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    def wrapped(seed: int, group: Any) -> tuple[FSDP, torch.optim.Optimizer]:
        # FSDP1 on CPU needs device_id=cpu (gloo too); it broadcasts rank 0's weights
        model = FSDP(_mlp(seed + w.rank), device_id=torch.device("cpu"), process_group=group)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, group in _groups(w):
        src, src_opt = wrapped(0, group)
        for _ in range(2):
            _step(src, src_opt, w.rank)
        with FSDP.state_dict_type(src, StateDictType.SHARDED_STATE_DICT):
            state = {"model": src.state_dict()}
            saved = _flat(state)
            dcp.save(state, checkpoint_id=f"{path}/{name}", process_group=group)
        dst, _ = wrapped(10, group)
        with FSDP.state_dict_type(dst, StateDictType.SHARDED_STATE_DICT):
            target = {"model": dst.state_dict()}
            dcp.load(target, checkpoint_id=f"{path}/{name}", process_group=group)
            dst.load_state_dict(target["model"])
            _same_state(saved, _flat({"model": dst.state_dict()}), f"{name}: shards")
        with FSDP.summon_full_params(src), FSDP.summon_full_params(dst):
            want = {k: v.detach().clone() for k, v in src.named_parameters()}
            got = {k: v.detach().clone() for k, v in dst.named_parameters()}
        _same_state(want, got, f"{name}: full parameters")
        full[name] = got
    _same_state(full["plait"], full["gloo"], "plait vs gloo")


def test_fsdp1_dcp_save_and_load(world: Any, tmp_path: Path) -> None:
    world.run(case_fsdp1_dcp, str(tmp_path))


# -- torchrun --------------------------------------------------------------------------------

def _torchrun(script: str, *args: str, max_restarts: int = 0, timeout: float = 90
              ) -> str:
    """Run ``tests/torch/<script> args`` under torchrun with 2 ranks; its output."""
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this checkout's plait
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--max-restarts={max_restarts}",
           "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--monitor-interval=0.1",
           str(Path(__file__).with_name(script)), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _trained(script: str, backend: str, out: Path) -> list[Any]:
    """Each rank's {"params", "losses"} after ``script backend out`` under torchrun."""
    out.mkdir()
    _torchrun(script, backend, str(out), timeout=180)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("init", ["torch", "plait"])
def test_torchrun_restart_after_a_rank_exits_before_init(init: str) -> None:
    # 90 s: well past the ranks' own 20 s rendezvous timeout plus two startups, so a
    # stale generation shows as plait's error rather than as a killed torchrun
    out = _torchrun("torchrun_restart.py", init, max_restarts=1, timeout=90)
    want = sum(torch.arange(6, dtype=torch.int64) * (r + 1) + 100 * r for r in range(2))
    for rank in range(2):
        line = f"plait-restart-ok rank={rank} attempt=1 sum={want.tolist()}"
        assert line in out, out[-4000:]
    assert "attempt=0 sum" not in out, out[-4000:]


# -- accelerate and Lightning (slow tier; pinned in tests/torch/clients-requirements.txt) --

@pytest.mark.slow
def test_accelerate_after_init_process_group_matches_gloo(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="pip install --no-deps -r "
                        "tests/torch/clients-requirements.txt")
    got = {b: _trained("accelerate_train.py", b, tmp_path / b) for b in ("plait", "gloo")}
    assert got["plait"] == got["gloo"], got  # floats through JSON: bitwise equal


@pytest.mark.slow
def test_lightning_ddp_matches_gloo(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning", reason="pip install --no-deps -r "
                        "tests/torch/clients-requirements.txt")
    got = {b: _trained("lightning_train.py", b, tmp_path / b) for b in ("plait", "gloo")}
    assert got["plait"] == got["gloo"], got  # floats through JSON: bitwise equal


# -- the key prefix on its own (one process) ---------------------------------------------------

def test_key_prefix_counts_per_restart_attempt() -> None:
    store = dist.HashStore()
    single = {"TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "1"}
    # attempt 0: rank 0 counts itself, rank 1 never does (it exited before init)
    assert key_prefix(store, 0, 2, single) == "plait/r0/0"
    # attempt 1: both count from zero again and agree
    again = {**single, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert [key_prefix(store, r, 2, again) for r in (1, 0)] == ["plait/r1/0"] * 2
    assert [key_prefix(store, r, 2, again) for r in (0, 1)] == ["plait/r1/1"] * 2
    # outside torchrun: the plain counter
    assert key_prefix(store, 0, 1, {}) == "plait/0"
    assert key_prefix(store, 0, 1, {}) == "plait/1"


def test_restart_attempt_only_where_every_rank_shares_it() -> None:
    assert restart_attempt({}) is None
    assert restart_attempt({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_attempt({"TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "1"}) == 2
    # several torchrun agents count restarts each for their own node: not an attempt id
    assert restart_attempt({"TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "2"}) is None
    with pytest.raises(ValueError, match="rank 3, init: TORCHELASTIC_RESTART_COUNT='x'"):
        key_prefix(dist.HashStore(), 3, 4, {"TORCHELASTIC_RESTART_COUNT": "x"})
