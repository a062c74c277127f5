"""Failure scope of derived communicators (membership.Scope): a peer's death breaks
exactly the communicators that contain it (a tensor-parallel group without the lost rank
keeps working); abort() reaches every communicator derived from the aborted one."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from plait.testing.spawn import run_ranks


def _worker(rank: int, port: int, case: str, q: Any) -> None:
    try:
        import torch.distributed as dist

        import plait

        store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0,
                              wait_for_workers=False)
        comm = plait.init(rank, 4, store=store, timeout=30)
        pair = comm.split(rank // 2)  # {0, 1} and {2, 3}
        assert pair is not None
        x = np.arange(6, dtype=np.int64) + 10 * rank
        pair.allreduce(x)
        comm.barrier()
        if case == "kill":
            if rank == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                comm.allreduce(np.ones(4, dtype=np.float32))
                world = "no error"
            except plait.PeerFailedError as exc:
                world = f"{exc.peer}: {exc}"
            # the pair without rank 3 carries on; rank 2's pair contains it
            got: Any
            try:
                y = np.arange(5, dtype=np.int64) * (rank + 1)
                pair.allreduce(y)
                got = y.tolist()
            except plait.PeerFailedError as exc:
                got = f"failed {exc.peer}"
            q.put((rank, world, got, time.monotonic() - t0))
        else:  # abort: rank 0 aborts the world; its pair is aborted with it
            if rank == 0:
                time.sleep(0.5)
                comm.abort()
                q.put((rank, "aborted", pair.describe().get("transports")))
            else:
                try:
                    z = np.arange(3, dtype=np.int32) * (rank + 1)
                    if rank == 1:
                        pair.allreduce(z)  # rank 0 aborts instead of joining
                    else:  # the other pair is not disturbed: its sum is exact
                        pair.allreduce(z)
                        first = 2 * (rank // 2) + 1  # ranks 2 and 3: factors 3 and 4
                        if z.tolist() != [(first + first + 1) * i for i in range(3)]:
                            raise AssertionError(f"rank {rank}: wrong sum {z.tolist()}")
                    q.put((rank, "ok", None))
                except plait.PlaitError as exc:
                    q.put((rank, type(exc).__name__, getattr(exc, "peer", None)))
        if case != "kill" or rank in (0, 1):
            pair.close()
            comm.close()
        else:  # rank 2: its communicators are broken; exit at once, results flushed first
            q.close()
            q.join_thread()
            os._exit(0)
    except BaseException as exc:
        q.put((rank, f"error: {type(exc).__name__}: {exc}", None, None))


def _run(case: str, expect: int) -> list[Any]:
    return run_ranks(_worker, 4, case, expect=expect)


def test_a_lost_rank_breaks_only_the_communicators_that_contain_it() -> None:
    out = _run("kill", 3)
    by_rank = {r[0]: r for r in out}
    for rank in (0, 1, 2):
        _, world, got, elapsed = by_rank[rank]
        assert world.startswith("3: "), (rank, world)  # the world names the lost rank
        assert elapsed < 10, (rank, elapsed)
        if rank == 2:
            assert got == "failed 1", got  # rank 3 is rank 1 of rank 2's pair
        else:
            assert got == [3 * i for i in range(5)], (rank, got)


def test_abort_reaches_derived_communicators() -> None:
    out = _run("abort", 4)
    by_rank = {r[0]: r for r in out}
    assert by_rank[0][1] == "aborted"
    assert by_rank[1][1] == "PeerFailedError" and by_rank[1][2] == 0, by_rank[1]
    assert by_rank[2][1] == "ok" and by_rank[3][1] == "ok", out
