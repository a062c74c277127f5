"""Starting and stopping the plait backend: every init_method, launchers, clean shutdown.

The rank cases here start their own torch.distributed worlds (``run_fresh``): env://
(torchrun), tcp://, file://, and plait:// under faked Open MPI, PMI and Slurm variables
(no real launcher is installed here). After each ``destroy_process_group`` no thread,
file descriptor (socket or other) or /dev/shm entry may be left over.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from plait_torch_world import data, same

from plait.testing.harness import free_port

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                  "SLURM_NTASKS")


def _resources() -> dict[str, set[str]]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the fd of the listing itself
    return {"threads": {f"{t.name}#{t.ident}" for t in threading.enumerate()},
            "fds": fds,
            "shm": {n for n in os.listdir("/dev/shm") if "plait" in n}}


def _baseline() -> dict[str, set[str]]:
    """Resources before init, once torch's process-wide helpers exist: the first TCPStore
    server of a process opens a pipe that stays open for the life of the process (gloo
    shows the same), which is not the backend's to close."""
    import datetime

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    del store
    gc.collect()
    return _resources()


def _leftovers(before: dict[str, set[str]]) -> dict[str, set[str]]:
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        after = _resources()
        new = {k: after[k] - before[k] for k in after if after[k] - before[k]}
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.1)  # a closing thread may need a moment to exit


def _methods(rank: int, size: int, ports: list[int], path: str
             ) -> list[tuple[str, str, dict[str, str], dict[str, int]]]:
    """(name, init_method, environment, init_process_group kwargs) of every launch."""
    local = {"MASTER_ADDR": "127.0.0.1"}
    explicit = {"rank": rank, "world_size": size}
    return [
        ("env:// (torchrun)", "env://", {**local, "MASTER_PORT": str(ports[0]),
                                         "RANK": str(rank), "WORLD_SIZE": str(size)}, {}),
        ("tcp://", f"tcp://127.0.0.1:{ports[1]}", {}, explicit),
        ("file://", f"file://{path}", {}, explicit),
        ("plait:// Open MPI", "plait://", {**local, "MASTER_PORT": str(ports[2]),
                                           "OMPI_COMM_WORLD_RANK": str(rank),
                                           "OMPI_COMM_WORLD_SIZE": str(size)}, {}),
        ("plait:// PMI", "plait://", {**local, "MASTER_PORT": str(ports[3]),
                                      "PMI_RANK": str(rank), "PMI_SIZE": str(size)}, {}),
        ("plait:// Slurm", "plait://", {**local, "MASTER_PORT": str(ports[4]),
                                        "SLURM_PROCID": str(rank),
                                        "SLURM_NTASKS": str(size)}, {}),
        ("plait://HOST:PORT", f"plait://127.0.0.1:{ports[5]}",
         {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size)}, {}),
    ]


def case_init_methods(info: Any, addr: Any, key: str, ports: list[int], path: str
                      ) -> dict[str, dict[str, list[str]]]:
    import datetime

    import plait.torch  # noqa: F401 - registers the backend (import torch does too)

    saved = {k: os.environ.pop(k) for k in _LAUNCHER_VARS if k in os.environ}
    leaks: dict[str, dict[str, list[str]]] = {}
    try:
        before = _baseline()
        for name, method, env, kwargs in _methods(info.rank, info.size, ports, path):
            os.environ.update(env)
            try:
                dist.init_process_group("plait", init_method=method,
                                        timeout=datetime.timedelta(seconds=30), **kwargs)
                assert dist.get_backend() == "plait", name
                assert (dist.get_rank(), dist.get_world_size()) == (info.rank, info.size), name
                t = data("int64", 5, info.rank, op="sum")
                dist.all_reduce(t)
                same(t, sum(data("int64", 5, r, op="sum") for r in range(info.size)), name)
                dist.barrier()
                dist.destroy_process_group()
            finally:
                for k in env:
                    os.environ.pop(k, None)
            left = _leftovers(before)
            if left:
                leaks[name] = {k: sorted(v) for k, v in left.items()}
    finally:
        os.environ.update(saved)
    return leaks


def case_subgroup_shutdown(info: Any, addr: Any, key: str, port: int) -> dict[str, list[str]]:
    """Subgroups, async work and p2p threads are gone after destroy_process_group()."""
    import datetime

    import plait.torch  # noqa: F401

    before = _baseline()
    dist.init_process_group("plait", init_method=f"tcp://127.0.0.1:{port}", rank=info.rank,
                            world_size=info.size, timeout=datetime.timedelta(seconds=30))
    g = dist.new_group(backend="plait")
    t = torch.ones(3)
    dist.all_reduce(t, group=g, async_op=True).wait()
    right, left = (info.rank + 1) % info.size, (info.rank - 1) % info.size
    r = dist.irecv(torch.zeros(3), left)
    dist.isend(t, right).wait()
    r.wait()
    dist.destroy_process_group()
    return {k: sorted(v) for k, v in _leftovers(before).items()}


@pytest.mark.parametrize("size", [2, 3])
def test_init_methods_and_clean_shutdown(worlds: Any, size: int, tmp_path: Any) -> None:
    world = worlds.get(size)
    ports = [free_port() for _ in range(6)]
    leaks = world.run_fresh(case_init_methods, ports, str(tmp_path / "filestore"))
    assert all(not x for x in leaks), leaks


def test_subgroups_async_and_p2p_shut_down_clean(worlds: Any) -> None:
    leaks = worlds.get(2).run_fresh(case_subgroup_shutdown, free_port())
    assert all(not x for x in leaks), leaks


# -- the plait:// handler on its own (one process) ---------------------------------------------

def test_plait_rendezvous_needs_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.torch import rendezvous

    for k in _LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK"):
        next(rendezvous._handler("plait://"))
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        next(rendezvous._handler("plait://"))


def test_plait_rendezvous_order_and_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.torch import rendezvous

    for k in _LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    # Open MPI wins over Slurm (plait.init's order); the URL's address wins over MASTER_*
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("MASTER_ADDR", "203.0.113.1")  # unreachable: must not be used
    monkeypatch.setenv("MASTER_PORT", "1")
    port = free_port()
    store, rank, size = next(rendezvous._handler(f"plait://127.0.0.1:{port}"))
    assert (rank, size) == (0, 1)
    store.set("k", "v")
    assert store.get("k") == b"v"
    # rank and world_size given to init_process_group win
    port = free_port()
    store, rank, size = next(rendezvous._handler(f"plait://127.0.0.1:{port}"
                                                 "?rank=0&world_size=1"))
    assert (rank, size) == (0, 1)
