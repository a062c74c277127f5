"""Train a small MLP with DistributedDataParallel on the plait backend.

    torchrun --nproc-per-node=2 examples/ddp_train.py               # plait
    torchrun --nproc-per-node=2 examples/ddp_train.py --backend gloo
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 \\
        python examples/ddp_train.py --init-method plait://

Prints the loss of every step on rank 0 and the mean step time at the end. See
docs/TORCH.md for every launcher.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="plait")
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024, help="hidden layer width")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fp16-hook", action="store_true",
                        help="compress gradients to float16 (DDP comm hook)")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.backend == "plait":
        import plait.torch  # noqa: F401 - registers it (an installed plait does on import torch)
    dist.init_process_group(args.backend, init_method=args.init_method)
    rank, size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    )
    ddp = DDP(model)
    if args.fp16_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard of data
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
    if rank == 0:
        steady = sorted(times[len(times) // 4:])  # leave out warm-up steps
        print(f"backend {args.backend}, {size} ranks: median step "
              f"{1e3 * steady[len(steady) // 2]:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
