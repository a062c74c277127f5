"""The TCP transport: every peer this rank cannot reach through shared memory.

Each rank listens on one socket per communicator (bound to its rail's address, see
topology/rails.py) and publishes the address in the store; connections are made lazily,
one way (transport/tcp.py: ``TcpHub``), striped over ``PLAIT_NSOCKS`` sockets for large
messages (transport/streams.py). Reader threads always drain their sockets, into the
posted receive when there is one (``CollInbox``), so a sender never waits for the
receiving rank's application thread and no ordering of sends and receives between ranks
can deadlock. Requests are ``driven_by = "thread"``: waiters sleep on the doorbell at once
and the reader rings it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np

from ..errors import MismatchError, PeerFailedError
from ..reduce import Reducer
from ..topology.rails import rail_address
from . import wire
from .base import THREAD, OpCtx, QuietPeers, Request, Site, WaitFor
from .futex import Bell, private_bell
from .streams import StripedSend, Striper
from .tcp import Outbound, TcpHub, recv_exact_into


class TcpSend(Request):
    """Sends one frame per ``progress()``: a blocking send, which always completes because
    the peer's reader thread drains its socket whatever its application thread does."""

    __slots__ = ("first", "idx", "off", "out", "seq", "src")
    is_send = True
    driven_by = THREAD

    def __init__(self, peer: int, out: Outbound, src: np.ndarray, seq: int, idx: int) -> None:
        super().__init__(peer)
        self.out, self.src, self.seq, self.idx = out, src, seq, idx
        self.off = 0
        self.first = True

    def progress(self) -> bool:
        if self.done:
            return False
        n = len(self.src)
        m = min(self.out.max_frame, n - self.off)
        self.out.send_frame(wire.KIND_COLL, self.idx, self.seq, self.off,
                            self.src[self.off:self.off + m], n)
        self.off += m
        if self.off >= n:
            self.done = True
        return True


class TcpRecv(Request):
    __slots__ = ("dst", "error", "got", "inbox", "itemsize", "key", "n", "reducer",
                 "storage", "typed", "where")
    driven_by = THREAD

    def __init__(self, peer: int, inbox: CollInbox, dst: np.ndarray, reducer: Reducer | None,
                 seq: int, idx: int, where: str) -> None:
        super().__init__(peer)
        self.inbox = inbox
        self.typed = dst
        self.storage = dst.dtype
        self.itemsize = dst.dtype.itemsize
        self.dst = dst.view(np.uint8)
        self.n = len(self.dst)
        self.reducer = reducer
        self.key = (seq, idx)
        self.where = where
        self.got = -1  # bytes received; -1 until the first frame (messages may be empty)
        self.error: BaseException | None = None
        inbox.post(self)

    def check(self, f: wire.Frame) -> None:
        if f.total != self.n:
            self.error = MismatchError(
                f"{self.where}: from rank {self.peer} expected {self.n} bytes for message "
                f"{self.key[1]} of collective #{self.key[0]}, got {f.total}: the ranks passed "
                f"different sizes")

    def apply(self, f: wire.Frame, payload: np.ndarray) -> None:
        if self.error is not None or f.length == 0:
            return
        if self.reducer is None:
            np.copyto(self.dst[f.offset:f.offset + f.length], payload)
        else:
            e0 = f.offset // self.itemsize
            cnt = f.length // self.itemsize
            self.reducer(self.typed[e0:e0 + cnt], payload.view(self.storage))

    def progress(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.got >= self.n:
            self.done = True
            return True
        failed = self.inbox.failed
        if failed is not None:
            self.inbox.drain_pending(self)
            if self.got < self.n:
                raise failed
        return False


class CollInbox:
    """Collective frames arriving from one peer over TCP, matched by (seq, message)."""

    def __init__(self, peer: int, bell: Bell) -> None:
        self.peer = peer
        self.bell = bell
        self.lock = threading.Lock()
        self.posted: dict[tuple[int, int], TcpRecv] = {}
        self.unexpected: dict[tuple[int, int], list[tuple[wire.Frame, np.ndarray]]] = {}
        self.failed: BaseException | None = None
        # per reader thread: with several sockets per peer, readers deliver concurrently
        self._scratch = threading.local()

    def post(self, req: TcpRecv) -> None:
        with self.lock:
            pending = self.unexpected.pop(req.key, None)
            self.posted[req.key] = req
            if pending:
                for f, payload in pending:
                    self._deliver_locked(req, f, payload)

    def drain_pending(self, req: TcpRecv) -> None:
        with self.lock:
            for f, payload in self.unexpected.pop(req.key, []):
                self._deliver_locked(req, f, payload)

    def _deliver_locked(self, req: TcpRecv, f: wire.Frame, payload: np.ndarray) -> None:
        req.check(f)
        req.apply(f, payload)
        self._count_locked(req, f)

    def _count_locked(self, req: TcpRecv, f: wire.Frame) -> None:
        req.got = max(req.got, 0) + f.length
        if req.got >= req.n or req.error is not None:
            req.got = max(req.got, req.n) if req.error is None else req.got
            self.posted.pop(req.key, None)

    def deliver(self, f: wire.Frame, sock: socket.socket) -> None:
        """Called by the reader thread with the payload still in the socket."""
        key = (f.seq, f.tag)
        with self.lock:
            req = self.posted.get(key)
        if req is not None:
            req.check(f)
            if req.error is None and req.reducer is None and f.length:
                recv_exact_into(sock, memoryview(req.dst[f.offset:f.offset + f.length]))
            elif f.length:
                buf = self._scratch_for(f.length)
                recv_exact_into(sock, memoryview(buf))
                req.apply(f, buf)
            with self.lock:
                self._count_locked(req, f)
        else:
            payload = np.empty(f.length, dtype=np.uint8)
            if f.length:
                recv_exact_into(sock, memoryview(payload))
            with self.lock:
                req = self.posted.get(key)
                if req is not None:
                    self._deliver_locked(req, f, payload)
                else:
                    self.unexpected.setdefault(key, []).append((f, payload))
        self.bell.ring()

    def _scratch_for(self, n: int) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = np.empty(n, dtype=np.uint8)
        return buf[:n]

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            self.failed = exc
        self.bell.ring()


def peer_lost_error(rank: int, peer: int, cause: BaseException | None) -> PeerFailedError:
    how = "closed its communicator" if cause is None else f"was lost ({cause})"
    return PeerFailedError(f"rank {rank}: connection from rank {peer} {how}", peer)


class TcpChannel:
    """Collective messages to and from one remote peer."""

    def __init__(self, transport: TcpTransport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self.inbox = transport.inbox(peer)

    def send(self, view: np.ndarray, ctx: OpCtx, idx: int) -> Request:
        out = self.transport.outbound(self.peer, ctx.deadline)
        if out.striper is not None and len(view) > out.max_frame:
            return StripedSend(self.peer, out.striper, view, ctx.seq, idx,
                               self.transport.bell)
        return TcpSend(self.peer, out, view, ctx.seq, idx)

    def recv(self, view: np.ndarray, reducer: Reducer | None, ctx: OpCtx,
             idx: int) -> TcpRecv:
        return TcpRecv(self.peer, self.inbox, view, reducer, ctx.seq, idx, ctx.where)


class TcpTransport(QuietPeers):
    """Every peer not reached through shared memory. Losses arrive through the readers
    (``_on_peer_lost``): no liveness words or notices of its own (``QuietPeers``)."""

    name = "tcp"

    def __init__(self, site: Site) -> None:
        assert site.bell is not None
        self.rank = site.rank
        self.bell = site.bell
        self.meet = site.meet
        self.sink = site.sink
        self.lost = site.lost
        self.explain_loss = site.explain_loss
        self.local = set(site.local_ranks)
        self._inboxes: dict[int, CollInbox] = {}
        self._chans: dict[int, TcpChannel] = {}
        self._addrs: dict[int, tuple[str, int]] = {}
        cfg = site.cfg
        host, bind_src = rail_address(site.topology, site.rank, site.host_local_rank,
                                      cfg.socket_ifname, site.meet.store)
        self.hub: TcpHub | None = TcpHub(
            rank=site.rank, job=site.job, comm_uid=site.uid, secret=site.secret,
            bind_host=host, max_frame=cfg.tcp_chunk_size, on_frame=self._on_frame,
            on_peer_lost=self._on_peer_lost, nsocks=cfg.nsocks, bind_source=bind_src,
            striper=Striper)
        site.meet.set(f"tcp/{site.rank}", f"{self.hub.address[0]}:{self.hub.address[1]}")

    def can_connect(self, peer: int) -> bool:
        return peer != self.rank and peer not in self.local

    def address(self) -> tuple[str, int] | None:
        """Where this rank listens (None once closed)."""
        return None if self.hub is None else (self.hub.address[0], self.hub.address[1])

    def _sockets(self) -> list[list[socket.socket]]:
        """The sockets of each outgoing connection."""
        if self.hub is None:
            return []
        return [list(out.striper.socks) if out.striper is not None else [out.sock]
                for out in self.hub.outbound.values()]

    def source_addresses(self) -> list[str]:
        """The local addresses this rank's outgoing connections leave from."""
        return sorted({s.getsockname()[0] for socks in self._sockets() for s in socks})

    def channel(self, peer: int) -> TcpChannel:
        ch = self._chans.get(peer)
        if ch is None:
            ch = self._chans.setdefault(peer, TcpChannel(self, peer))
        return ch

    def inbox(self, peer: int) -> CollInbox:
        box = self._inboxes.get(peer)
        if box is None:
            box = self._inboxes.setdefault(peer, CollInbox(peer, self.bell))
            if peer in self.lost:
                box.fail(self.lost[peer])
        return box

    def outbound(self, peer: int, deadline: float) -> Outbound:
        hub = self.hub
        if hub is None:
            raise PeerFailedError(f"rank {self.rank}: the TCP transport is closed", peer)
        out = hub.outbound.get(peer)
        if out is not None:
            return out
        addr = self._addrs.get(peer)
        if addr is None:
            raw = self.meet.get(f"tcp/{peer}", max(0.001, deadline - time.monotonic())).decode()
            host, _, port = raw.rpartition(":")
            addr = self._addrs[peer] = (host, int(port))
        return hub.connect(peer, addr, deadline)

    def _on_frame(self, peer: int, f: wire.Frame, sock: socket.socket) -> None:
        if f.kind == wire.KIND_COLL:
            self.inbox(peer).deliver(f, sock)
        else:
            self.sink.on_frame(peer, f, lambda dst: recv_exact_into(sock, memoryview(dst)))

    def _on_peer_lost(self, peer: int, cause: BaseException | None) -> None:
        # a peer that gave up because of another rank's failure closes its connections
        # right after publishing the abort notice: health names the rank that failed
        exc = self.explain_loss(peer, peer_lost_error(self.rank, peer, cause))
        self.lost[peer] = exc
        self.inbox(peer).fail(exc)
        self.sink.peer_failed(peer, exc)

    # -- point to point -------------------------------------------------------------------

    def start_p2p(self) -> None:
        """Reader threads deliver point-to-point frames from the start."""

    def send_p2p(self, peer: int, tag: int, data: np.ndarray, deadline: float,
                 wait_for: WaitFor) -> None:
        if peer in self.lost:
            raise self.lost[peer]
        out = self.outbound(peer, deadline)
        with out.lock:
            seq = out.p2p_seq
            out.p2p_seq += 1
        out.send_message(wire.KIND_P2P, tag, seq, data)

    def host_collective(self, policy: Any) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        addr = self.address()
        return {"listen": addr[0] if addr else None, "port": addr[1] if addr else None,
                "sources": self.source_addresses(),
                "streams": max((len(socks) for socks in self._sockets()), default=0)}

    def close(self) -> bool:
        hub, self.hub = self.hub, None
        if hub is not None:
            hub.close()
        self._chans.clear()
        self._inboxes.clear()
        # the doorbell may be a view into the shared-memory segment, unmapped next
        self.bell = private_bell()
        return True
