"""The transports, in the order they are tried: for each peer the first that can reach
it carries its messages (shared memory before TCP).

Adding a transport: a module under transport/ with a class implementing
``transport.base.Transport`` (constructed from a ``Site``), and one entry here saying when
a communicator needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import Site, Transport
from .shm_link import ShmTransport
from .tcp_link import TcpTransport


@dataclass(frozen=True)
class TransportSpec:
    name: str
    wanted: Callable[[Site], bool]  # does this communicator need it on this rank?
    open: Callable[[Site], Transport]
    makes_bell: bool = False  # it owns the doorbell words (opened before those needing one)


TRANSPORTS: tuple[TransportSpec, ...] = (
    TransportSpec("shm", lambda site: len(site.local_ranks) > 1, ShmTransport,
                  makes_bell=True),
    TransportSpec("tcp", lambda site: len(site.local_ranks) < site.size, TcpTransport),
)


def names() -> tuple[str, ...]:
    return tuple(t.name for t in TRANSPORTS)
