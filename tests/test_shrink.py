"""``Communicator.shrink``: after a rank is SIGKILLed (or to drop live ranks) the survivors
agree on one set and carry on with a communicator of them (docs/RELIABILITY.md, "Shrink").

Real rank processes; every result on a shrunk communicator is checked exactly against
rank-dependent data; the rank that dies kills itself with SIGKILL mid-stream."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from plait.testing import reference as ref
from plait.testing.data import assert_equal, make, values
from plait.testing.harness import free_port
from plait.testing.leaks import leaks as _leaks
from plait.testing.leaks import resources as _resources


def _check_allreduce(comm: Any, seed: int, count: int = 1000) -> None:
    """A verified allreduce (exact, rank-dependent data) and a verified allgather of the
    old ranks, on ``comm``."""
    b = make("int64", count, comm.rank, op="sum", seed=seed)
    comm.allreduce(b)
    assert_equal(b, ref.allreduce([values("int64", count, r, op="sum", seed=seed)
                                   for r in range(comm.size)], "sum")[comm.rank],
                 f"allreduce on the shrunk communicator (seed {seed})")


def _stream_until_failure(comm: Any, victim: int, at: int) -> dict[str, Any]:
    """Verified allreduces on ``comm``; rank ``victim`` SIGKILLs itself before operation
    ``at`` (it has completed ``at`` of them). Returns when this rank sees the failure."""
    import plait

    try:
        for i in range(10_000):
            if comm.rank == victim and i == at:
                os.kill(os.getpid(), signal.SIGKILL)
            b = make("float32", 300, comm.rank, op="sum", seed=i)
            comm.allreduce(b)
            assert_equal(b, ref.allreduce([values("float32", 300, r, op="sum", seed=i)
                                           for r in range(comm.size)], "sum")[comm.rank],
                         f"allreduce {i}")
    except plait.PeerFailedError as exc:
        return {"peer": exc.peer, "msg": str(exc), "t_error": time.monotonic()}
    raise AssertionError(f"rank {comm.rank}: the stream survived the loss of rank {victim}")


def _shrink_and_check(comm: Any, seed: int, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    t0 = time.monotonic()
    res = comm.shrink(**kwargs)
    elapsed = time.monotonic() - t0
    new = res.comm
    assert (new.rank, new.size) == (res.ranks.index(comm.rank), len(res.ranks))
    # the new numbering is the old one, in order, without the lost ranks
    olds = np.empty(new.size, dtype=np.int64)
    new.allgather(np.array([comm.rank], dtype=np.int64), olds)
    assert olds.tolist() == list(res.ranks), (olds, res)
    _check_allreduce(new, seed)
    return new, {"shrink_s": elapsed, "ranks": res.ranks, "lost": res.lost,
                 "excluded": res.excluded, "last_seq": res.last_seq}


# --------------------------------------------------------------- after a SIGKILL


def case_shrink_after_sigkill(comm: Any, victim: int, at: int) -> dict[str, Any]:
    """A split pair without the victim keeps working; the survivors shrink the broken
    world and run verified collectives on the new one; nothing is left behind."""
    before = _resources(comm)
    others = [r for r in range(comm.size) if r != victim]
    pair = comm.split(0 if comm.rank in others[:2] else None)
    failed = _stream_until_failure(comm, victim, at)
    t_error = failed.pop("t_error")
    new, res = _shrink_and_check(comm, seed=7)
    res.update(failed)
    res["error_to_ready_s"] = time.monotonic() - t_error
    if pair is not None:  # a communicator without the lost rank is undisturbed
        _check_allreduce(pair, seed=8)
        pair.close()
    uid = new.describe()["identity"]["communicator"][:20]
    new.close()
    comm.close()  # the broken one (its connections made during the stream go with it)
    res["leaks"] = _leaks(before, uid)
    return res


@pytest.mark.parametrize(("size", "transport", "victim"),
                         [(3, "shm", 1), (4, "tcp", 0), (5, "mixed", 3)])
def test_shrink_after_sigkill(pools: Any, size: int, transport: str, victim: int) -> None:
    pool = pools.get(size, transport)
    pool.reset()  # fresh communicators: #1, #2 are the setup's allgathers (resources,
    # split), then the victim completes allreduces #3..#7 and dies
    results = pool.run(case_shrink_after_sigkill, victim, 5, may_die=[victim])
    survivors = [r for r in range(size) if r != victim]
    for r in survivors:
        res = results[r]
        assert res["peer"] == victim, (r, res)
        assert res["ranks"] == tuple(survivors) and res["lost"] == (victim,), (r, res)
        assert res["excluded"] == () and res["last_seq"] == 7, (r, res)
        assert res["shrink_s"] < 2.0, (r, res)
        assert not res["leaks"], (r, res["leaks"])


# --------------------------------------------------------------- twice in a row


def case_shrink_twice(comm: Any, first: int, second: int) -> dict[str, Any]:
    """World ``first`` dies, shrink; then old rank ``second`` dies on the shrunk
    communicator, shrink that one."""
    out: dict[str, Any] = {}
    _stream_until_failure(comm, first, 3)
    c1, out["first"] = _shrink_and_check(comm, seed=11)
    _stream_until_failure(c1, out["first"]["ranks"].index(second), 4)
    c2, out["second"] = _shrink_and_check(c1, seed=12)
    c2.close()
    c1.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_shrink_again_after_a_second_failure(pools: Any, transport: str) -> None:
    pool = pools.get(5, transport)
    pool.reset()
    results = pool.run(case_shrink_twice, 3, 1, may_die=[1, 3])
    for r in (0, 2, 4):
        one, two = results[r]["first"], results[r]["second"]
        assert one["ranks"] == (0, 1, 2, 4) and one["lost"] == (3,) and one["last_seq"] == 3
        # numbered in the first shrunk communicator (old rank 1 is its rank 1), whose
        # #1, #2 are _shrink_and_check's: the victim completed #3..#6
        assert two["ranks"] == (0, 2, 3) and two["lost"] == (1,) and two["last_seq"] == 6
        assert one["shrink_s"] < 2.0 and two["shrink_s"] < 2.0, results[r]


# ------------------------------------------------------- exclude, late ranks


def case_exclude_and_late(comm: Any) -> dict[str, Any]:
    """No failure. (1) every rank calls shrink(exclude=[last]): the last one is told it is
    out. (2) the last rank calls 2 s late, the others wait 0.5 s: it is dropped by all of
    them, and told so when it arrives. (3) the last rank does not call at all."""
    import plait

    last = comm.size - 1
    for i in range(3):
        _check_allreduce(comm, seed=20 + i, count=50)
    out: dict[str, Any] = {}
    if comm.rank == last:
        with pytest.raises(plait.ShrinkExcludedError, match="excluded") as info:
            comm.shrink(exclude=[last])
        assert info.value.members == tuple(range(last)), info.value.members
        time.sleep(2.0)
        with pytest.raises(plait.ShrinkExcludedError, match="did not join") as info:
            comm.shrink(timeout=0.5)
        out["late_msg"] = str(info.value)
        _check_allreduce(comm, seed=40, count=50)  # the old one, unbroken, still works
        return out
    for step, kwargs in (("exclude", {"exclude": [last]}), ("late", {"timeout": 0.5}),
                         ("absent", {"exclude": [last]})):
        new, out[step] = _shrink_and_check(comm, seed=30, **kwargs)
        new.close()
    _check_allreduce(comm, seed=40, count=50)  # the old one, unbroken, still works
    return out


def test_shrink_exclude_and_late_rank(pools: Any) -> None:
    size = 4
    pool = pools.get(size, "shm")
    pool.reset()
    results = pool.run(case_exclude_and_late)
    for r in range(size - 1):
        res = results[r]
        for step in ("exclude", "absent"):
            assert res[step]["ranks"] == (0, 1, 2) and res[step]["excluded"] == (3,), res
            assert res[step]["lost"] == () and res[step]["last_seq"] == 3, res
        assert res["late"]["ranks"] == (0, 1, 2) and res["late"]["lost"] == (3,), res
        assert res["late"]["excluded"] == (), res
    assert "rank 3, shrink #2" in results[3]["late_msg"], results[3]


# ----------------------------------------------------- the store dies with rank 0


def case_store_lost(info: Any, port: int) -> dict[str, Any] | None:
    """Rank 0 hosts the TCPStore (plait.init from MASTER_ADDR/MASTER_PORT) and dies."""
    import plait

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(info.rank), "WORLD_SIZE": str(info.size)})
    comm = plait.init(timeout=30)
    _stream_until_failure(comm, 0, 3)
    t0 = time.monotonic()
    with pytest.raises(plait.StoreLostError) as err:
        comm.shrink()
    msg = str(err.value)
    res = {"msg": msg, "elapsed": time.monotonic() - t0}
    comm.close()
    return res


def test_shrink_without_its_store_says_so(pools: Any) -> None:
    pool = pools.get(3, "shm", init="none")
    results = pool.run(case_store_lost, free_port(), may_die=[0])
    for r in (1, 2):
        msg = results[r]["msg"]
        assert f"rank {r}, shrink #1" in msg, msg
        assert "needs a store that outlives the lost rank" in msg, msg
        assert results[r]["elapsed"] < 10, results[r]


def test_bad_exclude_is_refused() -> None:
    from plait.shrink import check_exclude

    assert check_exclude([2, 0, 2], 3, 1) == {0, 2}
    with pytest.raises(ValueError, match="rank 1, shrink: exclude entry 3"):
        check_exclude([3], 3, 1)
    with pytest.raises(TypeError, match="sequence of ranks"):
        check_exclude(2, 3, 1)  # type: ignore[arg-type]
