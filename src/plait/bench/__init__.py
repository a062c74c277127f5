"""``plait bench``: an nccl-tests-style benchmark with gloo and MPI side by side.

Layout: :mod:`~plait.bench.options` (the command line), :mod:`~plait.bench.collectives`
(per-operation hooks: sizes, bus-bandwidth factors, exact data, expected results),
:mod:`~plait.bench.backends` (plait's API, torch.distributed on plait or gloo, MPI),
:mod:`~plait.bench.loop` (the one timing loop), :mod:`~plait.bench.setup` (rendezvous),
:mod:`~plait.bench.launch` (starting local ranks), :mod:`~plait.bench.results` (the
measured rows), :mod:`~plait.bench.report` (table, JSON, plot).
"""

from __future__ import annotations

from .options import OPS, BenchOptions

__all__ = ["OPS", "BenchOptions"]
