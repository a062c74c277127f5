"""Run by tests/torch/test_torch_clients.py under torchrun: accelerate training on a group
made first with ``init_process_group(sys.argv[1])`` (the documented route for plait:
accelerate refuses ``InitProcessGroupKwargs(backend="plait")`` itself).

Writes each rank's final parameters and losses to ``sys.argv[2]/<rank>.json``, to
compare between backends.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    backend = sys.argv[1]
    if backend == "plait":
        import plait.torch  # noqa: F401 - registers the backend
    dist.init_process_group(backend)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.num_processes == dist.get_world_size() == 2
    assert dist.get_backend() == backend
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(acc.gather(loss.detach()).tolist())
    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    params = flat.double().tolist()
    # a file per rank: the two ranks' output lines interleave in torchrun's stdout
    with open(os.path.join(sys.argv[2], f"{acc.process_index}.json"), "w") as f:
        json.dump({"params": params, "losses": losses}, f)
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
