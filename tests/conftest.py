"""Shared fixtures: the multi-process pools (see plait.testing.harness) and the slow tier."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

WORLD_SIZES = (1, 2, 3, 4, 5)
TRANSPORTS = ("shm", "tcp")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The default tier leaves out tests marked slow; `-m slow` (or any -m) selects them.
    if not config.option.markexpr:
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    # Tests of one pool configuration run together: switching pools re-initialises the
    # rank processes' communicators. A stable sort keeps each group in file order.
    items.sort(key=_pool_key)


def _pool_key(item: pytest.Item) -> tuple[Any, ...]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "world" not in params:
        return (0,)
    return (1, str(params.get("transport", "shm")), int(params["world"]))


@pytest.fixture(scope="session")
def pools() -> Iterator[Any]:
    """The session's :class:`plait.testing.harness.PoolSet`.

    At the end every rank process must have exited, no ``Communicator.close`` may have
    failed, and no ``/dev/shm/plait*`` entry made during the session may remain.
    """
    from plait.testing.harness import PoolSet, shm_entries

    before = shm_entries()
    started = time.time()
    ps = PoolSet()
    try:
        yield ps
    finally:
        pids = ps.workers.pids()
        failures = list(ps.workers.close_failures)
        ps.close()
    leftover_pids = [p for p in pids if _alive(p)]
    new_shm = _new_shm(before, started)
    problems = []
    if failures:
        problems.append("Communicator.close failed while switching pools:\n"
                        + "\n".join(failures))
    if leftover_pids:
        problems.append(f"rank processes still alive after shutdown: {leftover_pids}")
    if new_shm:
        problems.append(f"shared-memory segments left in /dev/shm: {sorted(new_shm)}")
    if problems:
        pytest.fail("\n".join(problems))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _new_shm(before: set[str], since: float, settle: float = 3.0) -> set[str]:
    """Entries made during the session still present after ``settle`` seconds (other
    processes on the machine may create plait segments too: only new ones count)."""
    from plait.testing.harness import shm_entries

    deadline = time.monotonic() + settle
    while True:
        new = set()
        for name in shm_entries() - before:
            try:
                if os.stat(f"/dev/shm/{name}").st_mtime >= since - 1:
                    new.add(name)
            except FileNotFoundError:
                pass
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)
