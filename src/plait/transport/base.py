"""The transport interface: what the layers above may ask of a transport.

A **transport** connects this rank to some of its peers (``can_connect``). For each such
peer it opens a **channel** that makes **requests**: one message of a collective, sent or
received (optionally reduced into the destination). The executor progresses requests
without knowing their class: ``progress()`` moves what it can without blocking and says
whether it moved anything; ``done`` says whether the request has finished; ``driven_by``
says where progress comes from, which decides how to wait for it:

- ``"caller"``: ``progress()`` itself moves the data (shared memory): the waiting thread
  may spin, then sleep on its doorbell, which peers ring;
- ``"thread"``: another thread of this process moves the data (TCP readers and senders):
  spinning would hold the GIL that thread needs for up to the interpreter's switch
  interval (5 ms), so the waiter sleeps on the doorbell at once and the thread rings it.

A transport also carries point-to-point messages (``send_p2p``; incoming messages go to
the ``P2PSink`` it was opened with), reports peer liveness and carries abort notices
(``dead_peers``, ``notices``, ``publish_notice``: see plait.health), and reports where its
peers are for timeout diagnosis (``peer_states``).

A **host collective** runs one whole operation among the ranks of one host (all ranks of
the communicator local): the direct shared-memory algorithms today, a compiled engine
later. It returns a request like a channel does.

New transports: a module under transport/ implementing ``Transport`` and one entry in
transport/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from ..errors import CommTimeoutError, timed_out
from ..reduce import DType, ReduceOp, Reducer
from . import wire
from .futex import Bell

CALLER = "caller"
THREAD = "thread"


class OpCtx:
    """What waits, requests and error messages need to know about the running operation."""

    __slots__ = ("deadline", "name", "on_timeout", "rank", "seq", "timeout")

    def __init__(self, rank: int, name: str, seq: int, deadline: float, timeout: float,
                 on_timeout: Callable[[OpCtx, str], BaseException] | None = None) -> None:
        self.rank = rank
        self.name = name
        self.seq = seq
        self.deadline = deadline
        self.timeout = timeout
        # makes the timeout error (plait.health adds where every rank is)
        self.on_timeout = on_timeout

    @property
    def where(self) -> str:
        return f"rank {self.rank}, {self.name} #{self.seq}"

    def timeout_error(self, waiting_for: str) -> BaseException:
        message = (f"{self.where}: {timed_out(self.timeout)} for {waiting_for} (the "
                   f"operation's timeout, {self.timeout:g} s)")
        if self.on_timeout is None:
            return CommTimeoutError(message)
        return self.on_timeout(self, message)


class Request:
    """One message of a collective to or from one peer."""

    __slots__ = ("done", "peer")
    is_send: ClassVar[bool] = False
    driven_by: ClassVar[str] = CALLER

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.done = False

    def progress(self) -> bool:
        """Move what can be moved without blocking; True if anything moved. Raises the
        request's error (a mismatch, a lost peer)."""
        raise NotImplementedError


class DoneRequest(Request):
    """A request that completed when it was made (a host collective run inline)."""

    __slots__ = ()

    def __init__(self, peer: int = -1) -> None:
        super().__init__(peer)
        self.done = True

    def progress(self) -> bool:
        return False


class Channel(Protocol):
    """Ordered collective messages to and from one peer: both sides run the same schedule,
    so messages arrive in the order they are sent; each carries (op sequence number,
    message index, size) and a receiver that sees something else raises MismatchError."""

    peer: int

    def send(self, view: np.ndarray, ctx: OpCtx, idx: int) -> Request: ...

    def recv(self, view: np.ndarray, reducer: Reducer | None, ctx: OpCtx,
             idx: int) -> Request: ...


ReadInto = Callable[[np.ndarray], None]


class P2PSink(Protocol):
    """Where a transport delivers incoming point-to-point frames (plait.p2p.Engine)."""

    def on_frame(self, src: int, f: wire.Frame, read_into: ReadInto) -> None: ...

    def peer_failed(self, peer: int, exc: BaseException) -> None: ...

    def fail_all(self, exc: BaseException) -> None: ...


WaitFor = Callable[[Callable[[], bool], str], None]
"""``wait_for(ready, what)``: block until ``ready()``, with the operation's deadline and
failure checks; ``what`` completes "Timed out waiting <N>ms for ..."."""


@dataclass(frozen=True)
class PeerState:
    """Where a peer is, as a transport can see it (timeout diagnosis)."""

    closed: bool = False
    started: int = 0  # sequence number of the collective it is blocked in (0: none known)
    done: int = 0  # sequence number of the last collective it finished


class QuietPeers:
    """The liveness, notice and progress-word methods of a transport that learns of
    losses otherwise (TCP: its readers see the connection drop) and has no words to
    publish; also what health reads before its transports are open."""

    publishes_progress = False

    def dead_peers(self) -> list[tuple[int, str]]:
        return []

    def notices(self) -> list[tuple[int, int]]:
        return []

    def publish_notice(self, value: int) -> None:
        return None

    def peer_states(self) -> dict[int, PeerState]:
        return {}

    def mark(self, *, blocked: int | None = None, done: int | None = None) -> None:
        return None

    def mark_done(self, seq: int) -> None:
        return None


class Transport(Protocol):
    name: str

    def can_connect(self, peer: int) -> bool: ...

    def channel(self, peer: int) -> Channel: ...

    def send_p2p(self, peer: int, tag: int, data: np.ndarray, deadline: float,
                 wait_for: WaitFor) -> None:
        """Send one point-to-point message (in order per peer); returns once ``data`` may
        be reused."""
        ...

    def start_p2p(self) -> None:
        """Begin delivering incoming point-to-point messages to the sink (lazily: most
        communicators never use point-to-point)."""
        ...

    def dead_peers(self) -> list[tuple[int, str]]:
        """Peers known dead without having closed: (rank, what identifies the process)."""
        ...

    def notices(self) -> list[tuple[int, int]]:
        """Abort notices peers published on this transport: (by rank, value)."""
        ...

    def publish_notice(self, value: int) -> None: ...

    def peer_states(self) -> dict[int, PeerState]: ...

    def mark(self, *, blocked: int | None = None, done: int | None = None) -> None:
        """Tell peers the sequence number this rank is blocked in / has finished."""
        ...

    # True where ``mark_done`` publishes something: it runs after every collective
    publishes_progress: bool

    def mark_done(self, seq: int) -> None: ...

    def host_collective(self, policy: Any) -> HostCollective | None:
        """The direct host collective (shared memory, every rank local), or None;
        ``policy`` is how the communicator waits (transport.engine.WaitPolicy)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts for diagnostics and tests (addresses, single-copy peers)."""
        ...

    def close(self) -> bool:
        """Release everything; False if something still holds a view into shared memory
        (the caller drops it and calls again)."""
        ...


class HostCall:
    """One operation for a host collective: flat numpy views of storage dtype. A plain
    class with slots, not a dataclass: one is built per operation, on the small-message
    path."""

    __slots__ = ("counts", "dtype", "op", "recv", "reducer", "root", "rop", "send")

    def __init__(self, op: str, send: np.ndarray | None, recv: np.ndarray | None,
                 reducer: Reducer | None = None, root: int = 0,
                 counts: Sequence[int] = (), dtype: DType | None = None,
                 rop: ReduceOp | None = None) -> None:
        self.op = op
        self.send = send
        self.recv = recv
        self.reducer = reducer
        self.root = root
        self.counts = counts
        self.dtype = dtype  # what the bytes are (bfloat16 travels as uint16 storage)
        self.rop = rop


class HostCollective(Protocol):
    """Runs whole operations among the ranks of one host."""

    def supports(self, op: str, algo: str) -> bool: ...

    def start(self, algo: str, call: HostCall, ctx: OpCtx) -> Request: ...


@dataclass
class Site:
    """What a transport is opened with: who this rank is, its peers, its settings, and
    where to meet them. Built once per communicator by plait.fabric."""

    rank: int
    size: int
    hosts: Sequence[str]
    local_ranks: Sequence[int]  # ranks sharing this host's memory (this rank included)
    host_local_rank: int  # this process's local rank in the job's world: its rail
    cfg: Any  # plait.config.Config
    topology: Any  # plait.topology.model.Topology
    meet: Any  # plait.rendezvous.Meeting: the communicator's keys in the store
    uid: bytes
    job: bytes
    secret: bytes
    deadline: float
    timeout: float
    sink: P2PSink
    # a transport lost its connection to a peer: returns the error to report (an abort
    # notice may say why: plait.health), which the transport then fails requests with
    explain_loss: Callable[[int, BaseException], BaseException]
    lost: dict[int, BaseException]  # peers known lost, shared by fabric, health, transports
    spin_s: float = 0.0
    bell: Bell | None = None  # the communicator's doorbell, once a transport has made it
    p2p_bell: Bell | None = None
