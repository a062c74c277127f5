"""``torch.ops.plait.all_reduce_``: results, group lookup by name, errors, fake kernel.

Each case runs on every rank of a torch world (conftest.py) whose default group is plait.
Inputs are exact rank- and index-dependent data (plait.testing.data); results must equal
numpy's reduction of every rank's input, and ``dist.all_reduce`` on the same group,
bitwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from plait_torch_world import TORCH_DTYPES, World, data, same

from plait.testing import reference
from plait.testing.data import values
from plait.testing.harness import BIG_COUNT
from plait.torch.ops import OPS as PLAIT_OPS

SIZES = (2, 3, 4)
DTYPES = ("float32", "bfloat16")
# the op names functional collectives use, and dist's ReduceOp for the comparison
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
       "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX}
COUNTS = (1, 7, BIG_COUNT)


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, worlds: Any) -> Any:
    return worlds.get(request.param)


def _expected(dtype: str, count: int, ranks: list[int], op: str) -> torch.Tensor:
    red = PLAIT_OPS[op]
    inputs = [values(dtype, count, r, op=red) for r in ranks]
    out = np.ascontiguousarray(reference.reduce_arrays(inputs, red, dtype))
    return torch.from_numpy(out).to(TORCH_DTYPES[dtype])


def case_results(w: World) -> int:
    name = dist.group.WORLD.group_name
    checked = 0
    for dtype in DTYPES:
        for op, top in OPS.items():
            for count in COUNTS:
                what = f"plait.all_reduce_ {dtype} {op} count={count}"
                t = data(dtype, count, w.rank, op=PLAIT_OPS[op])
                via_dist = t.clone()
                torch.ops.plait.all_reduce_(t, name, op)
                same(t, _expected(dtype, count, list(range(w.size)), op), what + " vs numpy")
                dist.all_reduce(via_dist, op=top)
                same(t, via_dist, what + " vs dist.all_reduce")
                checked += 1
    # a strided view is reduced in place too; the rest of its base is untouched
    base = data("float32", 2 * 7, w.rank, op="sum")
    before = base.clone()
    torch.ops.plait.all_reduce_(base[::2], name, "SUM")
    same(base[::2], _expected("float32", 14, list(range(w.size)), "sum")[::2], "strided view")
    same(base[1::2], before[1::2], "strided view leaves the other elements")
    # a 2-D tensor, as a decoder's activations are
    x = data("bfloat16", 24, w.rank, op="sum")
    torch.ops.plait.all_reduce_(x.view(4, 6), name, "sum")
    same(x, _expected("bfloat16", 24, list(range(w.size)), "sum"), "2-D bfloat16")
    return checked


def case_sub_group(w: World) -> None:
    """A group of ranks 1..size-1 (named as funcol names it); rank 0 is not in it."""
    ranks = list(range(1, w.size))
    sub = dist.new_group(ranks)
    if w.rank in ranks:
        t = data("float32", 9, w.rank, op="max")
        torch.ops.plait.all_reduce_(t, sub.group_name, "max")
        same(t, _expected("float32", 9, ranks, "max"), "sub-group max")
        dist.destroy_process_group(sub)


def case_errors(w: World) -> None:
    t = torch.arange(3, dtype=torch.float32) + 10 * w.rank
    before = t.clone()
    with pytest.raises(TypeError, match=r"not a plait group.*gloo"):
        torch.ops.plait.all_reduce_(t, w.gloo.group_name, "sum")
    with pytest.raises(ValueError, match="no process group named 'no-such-group'"):
        torch.ops.plait.all_reduce_(t, "no-such-group", "sum")
    with pytest.raises(ValueError, match="unknown reduce op 'premul_sum'"):
        torch.ops.plait.all_reduce_(t, dist.group.WORLD.group_name, "premul_sum")
    same(t, before, "a refused call leaves the tensor as it was")
    # the group still works after the refused calls (nothing was half started)
    torch.ops.plait.all_reduce_(t, dist.group.WORLD.group_name, "sum")
    n = w.size
    same(t, torch.arange(3, dtype=torch.float32) * n + 10 * n * (n - 1) / 2, "sum after errors")


def case_fake(w: World) -> None:
    """Under FakeTensorMode the op runs its fake kernel: no communication, no error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        torch.ops.plait.all_reduce_(x, dist.group.WORLD.group_name, "sum")
        assert x.shape == (4, 8)
    schema = str(torch.ops.plait.all_reduce_.default._schema)
    assert schema == "plait::all_reduce_(Tensor(a!) t, str group_name, str op) -> ()", schema


def test_results(world: Any) -> None:
    assert world.run(case_results) == [len(DTYPES) * len(OPS) * len(COUNTS)] * world.size


def test_sub_group(world: Any) -> None:
    world.run(case_sub_group)


def test_errors(world: Any) -> None:
    world.run(case_errors)


def test_fake_kernel(world: Any) -> None:
    world.run(case_fake)
