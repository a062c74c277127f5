"""plait.Config given to plait.init and to the torch backend (pg_options): fields set win
over PLAIT_* variables; settings that must agree are checked at init; children derive
their parent's configuration."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from plait.testing.spawn import run_ranks


def _worker(rank: int, port: int, case: str, q: Any) -> None:
    try:
        import torch.distributed as dist

        import plait

        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                              wait_for_workers=False)
        if case == "explicit":
            os.environ["PLAIT_ALGO"] = "allreduce:rd"  # the explicit field must win
            with plait.init(rank, 2, store=store, timeout=30,
                            config=plait.Config(algo="allreduce:ring")) as comm:
                x = np.arange(5, dtype=np.int64) * (rank + 1)
                comm.allreduce(x)
                child = comm.split(0)
                assert child is not None
                y = np.arange(3, dtype=np.int64) + rank
                child.allreduce(y)
                algo = [r["algorithm"] for r in comm.flight_record() if r["op"] == "allreduce"]
                q.put((rank, x.tolist(), algo[0], y.tolist(),
                       child.flight_record()[-1]["algorithm"]))
                child.close()
        elif case == "mismatch":
            slot = (64 << 10) * (rank + 1)
            try:
                plait.init(rank, 2, store=store, timeout=30,
                           config=plait.Config(shm_slot_size=slot))
            except plait.MismatchError as exc:
                q.put((rank, str(exc)))
            else:
                q.put((rank, "no error"))
        elif case == "torch":
            import torch

            import plait.torch

            dist.init_process_group("plait", store=store, rank=rank, world_size=2,
                                    pg_options=plait.Config(algo="allreduce:ring"))
            t = torch.arange(4, dtype=torch.int32) + rank
            dist.all_reduce(t)
            pg = dist.distributed_c10d._get_default_group()
            q.put((rank, t.tolist(), pg.comm.flight_record()[-1]["algorithm"]))
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        q.put((rank, f"error: {type(exc).__name__}: {exc}"))


def _run(case: str) -> list[Any]:
    return run_ranks(_worker, 2, case)


def test_explicit_config_wins_and_children_inherit_it() -> None:
    out = _run("explicit")
    for rank, x, algo, y, child_algo in out:
        assert x == [3 * i for i in range(5)], (rank, x)
        assert algo == "ring", (rank, algo)
        assert y == [2 * i + 1 for i in range(3)], (rank, y)
        assert child_algo == "ring", (rank, child_algo)


def test_settings_that_must_agree_are_checked_at_init() -> None:
    out = _run("mismatch")
    for rank, msg in out:
        assert f"rank {rank}, init" in msg, msg
        assert "PLAIT_SHM_SLOT_SIZE" in msg, msg


def test_torch_backend_takes_a_config_through_pg_options() -> None:
    pytest.importorskip("torch")
    out = _run("torch")
    for rank, t, algo in out:
        assert t == [2 * i + 1 for i in range(4)], (rank, t)
        assert algo == "ring", (rank, algo)
