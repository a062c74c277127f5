"""Train a small MLP with FSDP2 (``fully_shard``) on the plait backend.

    torchrun --nproc-per-node=2 examples/fsdp2_train.py
    torchrun --nproc-per-node=2 examples/fsdp2_train.py --backend gloo

Parameters are sharded over a CPU DeviceMesh; FSDP2 all-gathers them before each layer
and reduce-scatters gradients (with ReduceOp.AVG) after. Prints the loss of every step
on rank 0. See docs/TORCH.md for every launcher.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="plait")
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.backend == "plait":
        import plait.torch  # noqa: F401 - registers it (an installed plait does on import torch)
    dist.init_process_group(args.backend, init_method=args.init_method)
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))

    torch.manual_seed(0)  # FSDP2 shards what each rank builds: build the same model
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(16, 32, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
