"""Fixtures of the torch backend tests: torch.distributed worlds on the harness's ranks.

``worlds.get(size)`` gives a :class:`TorchWorld`: ``run(fn, *args)`` runs
``fn(world, *args)`` on every rank of a torch.distributed world whose default group is
plait, with a gloo group over the same ranks for reference results (see
plait_torch_world.py). The world lives in the rank processes of the session's PoolSet
(``pools`` in tests/conftest.py) and is reused by every test of a module; it is made again
if the processes were restarted after a failure. ``run_fresh`` runs a case with no world
set up (tests of init methods and of shutdown).
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import plait_torch_world as ptw
import pytest
import torch.distributed as dist

_keys = itertools.count()


class TorchWorld:
    def __init__(self, worlds: Worlds, size: int) -> None:
        self.size = size
        self.addr = worlds.addr
        self.pool = worlds.pools.get(size, "shm", init="none")
        self._worlds = worlds
        self._pids: tuple[int, ...] = ()
        self._key = ""

    def _session_key(self) -> str:
        # Worlds of different sizes share rank processes, and a process holds one world
        # at a time: a new key (a new world) whenever another world ran in between or a
        # process was restarted after a failure.
        pids = tuple(self.pool.run(ptw.getpid_case))
        if pids != self._pids or not self._key or self._worlds.active is not self:
            self._pids = pids
            self._key = f"plait-torch/{os.getpid()}/{next(_keys)}/"
            self._worlds.active = self
        return self._key

    def run(self, fn: Callable[..., Any], *args: Any, deadline: float = 90.0,
            **kwargs: Any) -> list[Any]:
        """``fn(world, *args, **kwargs)`` on every rank; the per-rank results."""
        key = self._session_key()
        target = f"{fn.__module__}:{fn.__qualname__}"
        return self.pool.run(ptw.session_case, self.addr, key, target, args, kwargs,  # type: ignore[no-any-return]
                             deadline=deadline)

    def run_fresh(self, fn: Callable[..., Any], *args: Any, deadline: float = 90.0,
                  **kwargs: Any) -> list[Any]:
        """``fn(info, addr, key, *args, **kwargs)`` on every rank, with no world set up."""
        self._key = ""  # the next run() makes a new world
        self._worlds.active = None
        key = f"plait-torch-fresh/{os.getpid()}/{next(_keys)}/"
        target = f"{fn.__module__}:{fn.__qualname__}"
        return self.pool.run(ptw.fresh_case, self.addr, key, target, args, kwargs,  # type: ignore[no-any-return]
                             deadline=deadline)

    def close(self) -> None:
        if self._key:
            self._key = ""
            try:
                self.pool.run(ptw.end_case)
            except AssertionError:
                pass  # the processes were killed: nothing left to end


class Worlds:
    def __init__(self, pools: Any, addr: tuple[str, int]) -> None:
        self.pools = pools
        self.addr = addr
        self.active: TorchWorld | None = None
        self._worlds: dict[int, TorchWorld] = {}

    def get(self, size: int) -> TorchWorld:
        if size not in self._worlds:
            self._worlds[size] = TorchWorld(self, size)
        return self._worlds[size]

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()


@pytest.fixture(scope="session")
def torch_store() -> Iterator[tuple[str, int]]:
    """A TCPStore in the test process: the rendezvous of every torch world (by prefix)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    yield ("127.0.0.1", int(store.port))


@pytest.fixture(scope="module")
def worlds(pools: Any, torch_store: tuple[str, int]) -> Iterator[Worlds]:
    w = Worlds(pools, torch_store)
    yield w
    w.close()
