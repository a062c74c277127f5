"""plait's typed errors.

Every error message names this rank, the operation and, where there is one, its sequence
number and the peer involved, so that a log line from any rank says what went wrong where.
"""

from __future__ import annotations


class PlaitError(RuntimeError):
    """Base class of every error plait raises at run time."""


class CommTimeoutError(PlaitError, TimeoutError):
    """A wait passed its deadline (the operation's timeout or a ``Work.wait`` timeout)."""


class PeerFailedError(PlaitError):
    """A peer process died, closed its communicator or broke its connection."""

    def __init__(self, message: str, peer: int | None = None,
                 lost_id: tuple[str, int] | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        # (host identity, pid) of the lost process: the same on every communicator it
        # belonged to, so a parent or child communicator can name it in its own numbering
        self.lost_id = lost_id


class MismatchError(PlaitError):
    """Ranks called different operations, or the same operation with incompatible arguments."""


class TransportError(PlaitError):
    """A transport failed: a bad frame, a refused handshake, a socket error."""


class ClosedError(PlaitError):
    """The communicator was closed or aborted."""


class ShrinkExcludedError(PlaitError):
    """``shrink``: the survivors agreed on a communicator without this rank (it was
    excluded, or did not join within the timeout). ``members``: the ranks kept (numbered
    in the communicator that was shrunk)."""

    def __init__(self, message: str, rank: int, members: tuple[int, ...]) -> None:
        super().__init__(message)
        self.rank = rank
        self.members = members


class StoreLostError(PlaitError):
    """The rendezvous store stopped answering where it is needed to agree (``shrink``):
    shrink needs a store that outlives the lost rank."""


def timed_out(seconds: float) -> str:
    """The start of every timeout message, in torch's convention (gloo's "Timed out
    waiting 1000ms for ..."; torch's tests match ``" (Timed out|closed|timeout) "`` and
    ``"Timed out waiting <N>ms"``): ``"Timed out waiting 1500ms"``."""
    return f"Timed out waiting {max(0, round(seconds * 1000))}ms"


def where(rank: int, op: str, seq: int | None = None) -> str:
    """The common prefix of error messages: ``rank 3, allreduce #41``."""
    return f"rank {rank}, {op}" + (f" #{seq}" if seq is not None else "")
