"""plait as a torch.distributed backend.

``import plait.torch`` registers the backend ``"plait"`` and the ``plait://`` rendezvous
(an installed plait registers them on ``import torch`` too, through the entry point in
group ``torch.backends``)::

    dist.init_process_group("plait")                          # torchrun (env://)
    dist.init_process_group("plait", init_method="plait://")  # mpirun, srun

and the op ``torch.ops.plait.all_reduce_(t, group_name, op)`` (see :mod:`plait.torch.ops`).

See docs/TORCH.md.
"""

from __future__ import annotations

import sys


def _torch_is_importing() -> bool:
    """True while ``import torch`` runs: this import then comes from the entry point hook."""
    spec = getattr(sys.modules.get("torch"), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


try:
    from .backend import BACKEND_NAME, PlaitWork, ProcessGroupPlait, register
    from .elastic import shrink

    register()
    from . import ops

    ops.register()
except Exception:
    # The entry point hook runs inside `import torch`: raising there would break every
    # `import torch` in the environment. An explicit `import plait.torch` does raise.
    if not _torch_is_importing():
        raise

__all__ = ["BACKEND_NAME", "PlaitWork", "ProcessGroupPlait", "register", "shrink"]
