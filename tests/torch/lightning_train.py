"""Run by tests/torch/test_torch_clients.py under torchrun: Lightning DDP training with
``DDPStrategy(process_group_backend=sys.argv[1])``.

Writes each rank's final parameters and losses to ``sys.argv[2]/<rank>.json``, to
compare between backends.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    backend = sys.argv[1]
    if backend == "plait":
        import plait.torch  # noqa: F401 - registers the backend
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 1))
            self.losses: list[float] = []

        def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 1, generator=g))
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1,
                         strategy=DDPStrategy(process_group_backend=backend), max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    import torch.distributed as dist

    assert dist.get_backend() == backend
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()
    # a file per rank: the two ranks' output lines interleave in torchrun's stdout
    with open(os.path.join(sys.argv[2], f"{trainer.global_rank}.json"), "w") as f:
        json.dump({"params": params, "losses": model.losses}, f)


if __name__ == "__main__":
    main()
