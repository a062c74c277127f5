"""Run by tests/torch/test_torch_clients.py under ``torchrun --max-restarts=1``.

On the first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 exits with an error before it
initialises anything, while rank 0 has joined and waits for it; torchrun then restarts
both. On the second attempt both ranks must meet and all_reduce. ``sys.argv[1]`` picks
the init: ``torch`` (``init_process_group("plait")``) or ``plait`` (``plait.init()``).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch


def main() -> None:
    how = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if attempt == 0 and rank == 1:
        sys.exit(3)
    t = torch.arange(6, dtype=torch.int64) * (rank + 1) + 100 * rank
    # 20 s: a restarted rank waiting on a stale generation fails well before the test's
    # own timeout, with plait's rendezvous error in the log.
    timeout = datetime.timedelta(seconds=20)
    if how == "torch":
        import torch.distributed as dist

        import plait.torch  # registers the backend (an installed plait needs no import)

        dist.init_process_group("plait", timeout=timeout)
        dist.all_reduce(t)
        dist.destroy_process_group()
    else:
        import plait

        comm = plait.init(timeout=timeout)
        comm.allreduce(t)
        comm.close()
    want = sum(torch.arange(6, dtype=torch.int64) * (r + 1) + 100 * r for r in range(size))
    assert torch.equal(t, want), (t, want)
    # one write per line: the two ranks share torchrun's stdout
    sys.stdout.write(f"plait-restart-ok rank={rank} attempt={attempt} sum={t.tolist()}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
