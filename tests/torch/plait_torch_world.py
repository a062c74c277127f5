"""Rank-side half of the torch backend tests: a torch.distributed world kept across cases.

The harness's rank processes (plait.testing.harness, ``init="none"``) run cases; the
cases here set up ``torch.distributed`` once per world and reuse it: the default group is
plait, and a gloo group over the same ranks gives the reference results on the same
inputs in the same process. Starting processes and groups is what costs time here
(importing torch takes 1-2 s of CPU per process on 2 cores), not the checks.
"""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import plait.torch  # noqa: F401 - registers the backend

TIMEOUT = datetime.timedelta(seconds=30)


@dataclass
class World:
    """What a session case receives."""

    rank: int
    size: int
    gloo: Any  # a gloo group over the same ranks
    key: str
    addr: tuple[str, int]


_current: World | None = None


def _store(addr: tuple[str, int], prefix: str) -> Any:
    store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=TIMEOUT)
    return dist.PrefixStore(prefix, store)


def end_session() -> None:
    global _current
    if _current is not None:
        _current = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _resolve(target: str) -> Any:
    module, qualname = target.split(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def session_case(info: Any, addr: tuple[str, int], key: str, target: str,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``target(world, *args)`` in the world ``key``, made on first use."""
    global _current
    if _current is None or _current.key != key or not dist.is_initialized():
        end_session()
        dist.init_process_group("plait", store=_store(addr, key), rank=info.rank,
                                world_size=info.size, timeout=TIMEOUT)
        gloo = dist.new_group(backend="gloo")
        _current = World(info.rank, info.size, gloo, key, addr)
    return _resolve(target)(_current, *args, **kwargs)


def fresh_case(info: Any, addr: tuple[str, int], key: str, target: str,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``target(info, addr, key, *args)`` with no torch.distributed world set up."""
    end_session()
    return _resolve(target)(info, addr, key, *args, **kwargs)


def end_case(info: Any) -> None:
    end_session()


def getpid_case(info: Any) -> int:
    return os.getpid()


# -- helpers for the cases -----------------------------------------------------------------

TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}


def data(dtype: str, count: int, rank: int, *, op: Any = None, seed: int = 0) -> torch.Tensor:
    """Exact data that depends on rank and index (plait.testing.data) as a tensor."""
    from plait.testing.data import make

    return make(dtype, count, rank, op=op, seed=seed, lib="torch")  # type: ignore[no-any-return]


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Exact equality (dtype, shape and every element; NaN equal to NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    if not torch.equal(a, b):
        diff = (a != b).reshape(-1).nonzero()
        i = int(diff[0]) if len(diff) else -1
        raise AssertionError(f"{what}: {len(diff)} of {a.numel()} elements differ; first at "
                             f"{i}: {a.reshape(-1)[i].item()} vs {b.reshape(-1)[i].item()}")
