"""The torch internals the backend relies on, and its registration.

These tests fail loudly, naming the item, when a torch release changes a private API
plait.torch._compat uses, or renames a ProcessGroup method torch calls on the backend.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import plait
from plait.testing.harness import clean_environ, free_port
from plait.torch import _compat
from plait.torch.backend import PlaitWork, ProcessGroupPlait

# ProcessGroup methods torch 2.13 calls: from Python (distributed_c10d.py) and from C++
# through the pybind trampoline (PyProcessGroup.hpp), old names included.
CALLED_BY_TORCH = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
    "all_gather_single", "_allgather_base", "allgather_coalesced",
    "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall", "all_to_all_single", "alltoall_base",
    "gather", "scatter", "barrier", "send", "recv", "recv_anysource", "_start_coalescing",
    "_end_coalescing", "shutdown", "abort", "getBackendName", "getGroupName",
    "setGroupName", "getGroupDesc", "setGroupDesc",
)


def test_private_torch_apis_are_as_expected() -> None:
    problems = _compat.check()
    assert not problems, "torch changed what plait.torch._compat relies on:\n" + "\n".join(
        problems)


def test_torch_still_calls_these_methods() -> None:
    # the C++ virtuals (getBackendName, setGroupName, ...) have no Python binding to check
    base = set(dir(dist.ProcessGroup))
    missing_in_torch = [m for m in CALLED_BY_TORCH
                        if m not in base and not m.startswith(("get", "set"))]
    assert not missing_in_torch, f"torch's ProcessGroup no longer has {missing_in_torch}"
    for m in CALLED_BY_TORCH:
        assert m in ProcessGroupPlait.__dict__, f"ProcessGroupPlait lacks {m}"


class _FailedWork:
    """A plait Work that failed (the shape PlaitWork reads)."""

    source = None

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def wait(self, timeout: Any = None) -> bool:
        raise self._exc

    def exception(self) -> BaseException:
        return self._exc


def _failed_plait_work(message: str) -> PlaitWork:
    exc = plait.PeerFailedError(message)
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_exception(exc)
    return PlaitWork(fut, [_FailedWork(exc)], [])


def test_failed_work_raises_on_every_path() -> None:
    work = _failed_plait_work("rank 0, allreduce #3: peer 1 died")
    with pytest.raises(plait.PeerFailedError, match="peer 1 died"):  # Python wait
        work.wait()
    assert isinstance(work.exception(), plait.PeerFailedError)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(Exception, match="peer 1 died"):  # the future C++ callers get
        work.get_future().wait()
    # C++ wait: a functional-collective tensor waits on the Work from C++
    t = torch.ones(2)
    torch._C._distributed_c10d._register_work(t, work)
    with pytest.raises(Exception, match="peer 1 died"):
        torch.ops._c10d_functional.wait_tensor(t)


def test_future_value_is_the_tensor_list() -> None:
    out = [torch.ones(1)]
    fut: torch.futures.Future[Any] = torch.futures.Future()
    work = PlaitWork(fut, [], out)
    fut.set_result(out)
    assert work.get_future().wait()[0] is out[0]
    assert work.wait() is True and work.is_success()


def test_autoload_hook_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.torch import _autoload, backend

    def broken() -> None:
        raise RuntimeError("broken registration")

    monkeypatch.setattr(backend, "register", broken)
    _autoload.autoload()  # swallowed: a failing hook would break `import torch`


def test_register_is_idempotent() -> None:
    from plait.torch import register

    register()
    register()
    assert dist.Backend.backend_list.count("plait") == 1


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.value == "plait.torch._autoload:autoload" for ep in eps)


@pytest.mark.skipif(not _entry_point_installed(),
                    reason="plait is not installed (pip install -e .): no torch.backends entry")
def test_init_process_group_with_no_import() -> None:
    """After pip install, init_process_group("plait") works without importing plait."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "assert 'plait' not in sys.modules or 'plait.torch' in sys.modules\n"
        f"dist.init_process_group('plait', init_method='tcp://127.0.0.1:{free_port()}', "
        "rank=0, world_size=1)\n"
        "t = torch.arange(4.0); dist.all_reduce(t); assert t.tolist() == [0, 1, 2, 3]\n"
        "assert dist.get_backend() == 'plait'\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
