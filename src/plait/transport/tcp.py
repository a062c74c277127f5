"""TCP between hosts: a listener per communicator, lazily made one-way connections.

Each rank sends to a peer over a connection it made itself (``Outbound``) and reads
from connections the peer made (``Inbound``, one reader thread each). Readers always drain
the socket — into the destination buffer when the receive is posted, into a buffer of its
own otherwise — so a sender never waits for the receiving rank's application thread, and
no send/receive ordering between ranks can deadlock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..errors import PeerFailedError, TransportError
from . import wire

log = logging.getLogger("plait.tcp")

HANDSHAKE_TIMEOUT_S = 30.0


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOF raises ConnectionResetError."""
    n = len(view)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionResetError("connection closed by peer")
        got += r


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, parts: list[Any]) -> None:
    """Send header and payload with as few syscalls as possible."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    sent = sock.sendmsg(views)
    if sent == total:
        return
    for v in views:
        if sent >= len(v):
            sent -= len(v)
            continue
        sock.sendall(v[sent:])
        sent = 0


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


class Striper(Protocol):
    """Several sockets of one connection (transport/streams.py), made by the factory the
    hub is given: this module does not import streams, which builds on it."""

    socks: list[socket.socket]  # every socket of the connection, the first one included

    def send_message(self, kind: int, tag: int, seq: int, payload: np.ndarray) -> None: ...

    def submit(self, kind: int, tag: int, seq: int, payload: np.ndarray,
               done: Callable[[BaseException | None], None]) -> None: ...

    def close(self) -> None: ...


StriperFactory = Callable[["Outbound", list[socket.socket], int], Striper]

FrameHandler = Callable[[int, wire.Frame, socket.socket], None]
"""``handler(peer, frame, sock)`` must consume exactly ``frame.length`` payload bytes."""


class Outbound:
    """This rank's sending connection to one peer."""

    def __init__(self, sock: socket.socket, peer: int, max_frame: int) -> None:
        self.sock = sock
        self.peer = peer
        self.max_frame = max_frame
        self.lock = threading.Lock()
        self.p2p_seq = 0
        self.broken: BaseException | None = None
        self.striper: Striper | None = None  # when the connection has several sockets

    def send_frame(self, kind: int, tag: int, seq: int, offset: int, payload: np.ndarray,
                   total: int) -> None:
        hdr = wire.pack_header(kind, tag, seq, offset, len(payload), total)
        with self.lock:
            if self.broken is not None:
                raise self.broken
            try:
                if len(payload):
                    send_all(self.sock, [hdr, payload])
                else:
                    self.sock.sendall(hdr)
            except OSError as exc:
                self.broken = PeerFailedError(
                    f"connection to rank {self.peer} broke: {exc}", self.peer)
                raise self.broken from exc

    def send_message(self, kind: int, tag: int, seq: int, payload: np.ndarray) -> None:
        """All frames of one message, under the lock, so they stay contiguous (or, when
        larger than a frame on a multi-socket connection, striped over its sockets)."""
        total = len(payload)
        if self.striper is not None and total > self.max_frame:
            self.striper.send_message(kind, tag, seq, payload)
            return
        step = self.max_frame
        off = 0
        while True:
            n = min(step, total - off)
            self.send_frame(kind, tag, seq, off, payload[off:off + n], total)
            off += n
            if off >= total:
                return

    def close(self) -> None:
        if self.striper is not None:
            self.striper.close()
        with self.lock:
            try:
                if self.broken is None:
                    self.sock.sendall(wire.pack_header(wire.KIND_BYE, 0, 0, 0, 0, 0))
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class TcpHub:
    """Listener, connections and reader threads of one rank of one communicator."""

    def __init__(self, *, rank: int, job: bytes, comm_uid: bytes, secret: bytes,
                 bind_host: str, max_frame: int, on_frame: FrameHandler,
                 on_peer_lost: Callable[[int, BaseException | None], None],
                 nsocks: int = 1, bind_source: bool = False,
                 striper: StriperFactory | None = None) -> None:
        self.rank = rank
        # nsocks: sockets per outgoing connection (streams.Striper); bind_source: bind
        # outgoing sockets to bind_host, so traffic leaves from this rank's rail address
        self.nsocks = nsocks if striper is not None else 1
        self.make_striper = striper
        self.source = bind_host if bind_source else None
        self._open: dict[int, int] = {}  # peer -> inbound sockets still open
        self._open_lock = threading.Lock()
        self.job = job
        self.comm_uid = comm_uid
        self.secret = secret
        self.max_frame = max_frame
        self.on_frame = on_frame
        self.on_peer_lost = on_peer_lost
        self.outbound: dict[int, Outbound] = {}
        self._connect_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._inbound: list[socket.socket] = []
        self._closing = False
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((bind_host, 0))
        self.listener.listen(128)
        self.address = self.listener.getsockname()
        t = threading.Thread(target=self._accept_loop, name=f"plait-accept-r{rank}", daemon=True)
        t.start()
        self._threads.append(t)

    # -- accepting ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            if self._closing:
                sock.close()
                return
            t = threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                                 name=f"plait-reader-r{self.rank}")
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        try:
            peer = self._handshake_accept(sock)
        except (OSError, TransportError, ValueError) as exc:
            log.warning("rank %d: dropped connection from %s: %s", self.rank, addr, exc)
            sock.close()
            return
        self._inbound.append(sock)
        self._read_loop(sock, peer)

    def _handshake_accept(self, sock: socket.socket) -> int:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        raw = recv_exact(sock, wire.HELLO_SIZE)
        hello = wire.Hello.unpack(raw)
        if hello.job != self.job or hello.comm != self.comm_uid:
            raise TransportError("handshake for another job or communicator")
        if hello.dst != self.rank:
            raise TransportError(f"handshake for rank {hello.dst}, this is rank {self.rank}")
        nonce = os.urandom(16)
        sock.sendall(wire.pack_challenge(self.secret, raw, nonce))
        wire.check_response(self.secret, raw, nonce, recv_exact(sock, wire.RESPONSE_SIZE))
        # count the peer's live sockets before it may send (it waits for the ack): with
        # several sockets per peer, an orderly close is the last one's goodbye
        with self._open_lock:
            self._open[hello.src] = self._open.get(hello.src, 0) + 1
        try:
            sock.sendall(b"\x01")
        except BaseException:
            with self._open_lock:
                self._open[hello.src] -= 1
            raise
        sock.settimeout(None)
        tune(sock)
        return hello.src

    def _read_loop(self, sock: socket.socket, peer: int) -> None:
        hdr = bytearray(wire.HEADER_SIZE)
        view = memoryview(hdr)
        err: BaseException | None = None
        try:
            while True:
                recv_exact_into(sock, view)
                frame = wire.parse_header(hdr, self.max_frame)
                if frame.kind == wire.KIND_BYE:
                    return
                self.on_frame(peer, frame, sock)
        except TransportError as exc:
            log.warning("rank %d: bad frame from rank %d, connection dropped: %s",
                        self.rank, peer, exc)
            err = exc
        except OSError as exc:
            err = exc
        finally:
            try:
                sock.close()
            except OSError:
                pass
            with self._open_lock:
                left = self._open[peer] = self._open.get(peer, 1) - 1
            # a broken socket loses the peer at once; goodbyes only when every socket
            # has said it (frames on the others may still be in flight)
            if not self._closing and (err is not None or left <= 0):
                self.on_peer_lost(peer, err)

    # -- connecting --------------------------------------------------------------------

    def connect(self, peer: int, address: tuple[str, int], deadline: float) -> Outbound:
        with self._connect_lock:
            out = self.outbound.get(peer)
            if out is not None:
                return out
            sock = self._dial(peer, address, deadline)
            out = Outbound(sock, peer, self.max_frame)
            if self.nsocks > 1 and self.make_striper is not None:
                extra = []
                try:
                    for stream in range(1, self.nsocks):
                        extra.append(self._dial(peer, address, deadline, stream))
                except BaseException:
                    for s in [sock, *extra]:
                        s.close()
                    raise
                out.striper = self.make_striper(out, extra, self.rank)
            self.outbound[peer] = out
            return out

    def _dial(self, peer: int, address: tuple[str, int], deadline: float,
              stream: int = 0) -> socket.socket:
        delay = 0.01
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
                if self.source is not None:
                    sock.bind((self.source, 0))  # leave from this rank's rail
                sock.connect(address)
                hello = wire.Hello(wire.VERSION, stream, self.job, self.comm_uid, self.rank, peer,
                                   os.urandom(16)).pack()
                sock.sendall(hello)
                resp = wire.check_challenge(self.secret, hello,
                                            recv_exact(sock, wire.CHALLENGE_SIZE))
                sock.sendall(resp)
                if recv_exact(sock, 1) != b"\x01":
                    raise TransportError("handshake refused")
                sock.settimeout(None)
                tune(sock)
                return sock
            except (TimeoutError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() + delay > deadline:
                    raise PeerFailedError(f"rank {self.rank}: cannot connect to rank {peer} at "
                                          f"{address[0]}:{address[1]}: {exc}", peer) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except BaseException:
                sock.close()
                raise

    def close(self) -> None:
        self._closing = True
        for out in list(self.outbound.values()):
            out.close()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for s in list(self._inbound):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=5)
