"""plait: collective communication for Python and PyTorch.

Shared memory between ranks of one host, TCP between hosts, topology-aware algorithms.
Use it directly on numpy arrays and torch CPU tensors (``plait.init``) or as the
``torch.distributed`` backend ``"plait"``.
"""

from __future__ import annotations

from .comm import Communicator, init
from .config import Config
from .errors import (
    ClosedError,
    CommTimeoutError,
    MismatchError,
    PeerFailedError,
    PlaitError,
    ShrinkExcludedError,
    StoreLostError,
    TransportError,
)
from .reduce import ReduceOp
from .shrink import ShrinkResult
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "ClosedError",
    "CommTimeoutError",
    "Communicator",
    "Config",
    "MismatchError",
    "PeerFailedError",
    "PlaitError",
    "ReduceOp",
    "ShrinkExcludedError",
    "ShrinkResult",
    "StoreLostError",
    "TransportError",
    "Work",
    "__version__",
    "init",
]
