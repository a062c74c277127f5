"""The Communicator: plait's public API on numpy arrays and torch CPU tensors.

Every public method validates its arguments first (errors name the rank, the operation and
the problem, before any communication), then hands a closure to ``_submit``, which keeps
collectives in issue order: a synchronous operation on an idle communicator runs on the
caller's thread (handing it to another thread costs more than a small shared-memory
exchange), anything else goes through this communicator's progress thread.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import json
import logging
import os
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import p2p as p2pmod
from .algorithms import (
    allgather_bruck,
    allgather_ring,
    allreduce_rd,
    allreduce_ring,
    alltoall_pairwise,
    barrier_dissemination,
    broadcast_chain,
    broadcast_tree,
    direct,
    gather_linear,
    reduce_scatter_ring,
    reduce_tree,
)
from .algorithms.schedule import Schedule
from .buffers import Buf, as_buf, expect_count, same_dtype
from .config import Config, to_seconds
from .errors import ClosedError, CommTimeoutError, PlaitError
from .executor import OpCtx, Waiter, run
from .flightrec import ENDED, ERROR, ISSUED, STARTED, FlightRecorder
from .health import Health
from .reduce import ReduceOp, Reducer, divide
from .rendezvous import host_identity, launcher_rank_size, store_from_env
from .topology import discover as topo_discover
from .topology import file as topo_file
from .topology import model as topo_model
from .topology.order import ring_allreduce, ring_order
from .topology.rails import rail_address
from .transport import cma, shm, wire
from .transport.channels import (
    CollInbox,
    ShmRecv,
    ShmRing,
    ShmSend,
    TcpRecv,
    TcpSend,
    peer_lost_error,
)
from .transport.futex import cpu_count, private_bell
from .transport.tcp import Outbound, TcpHub, recv_exact_into
from .tuning import selector

log = logging.getLogger("plait")

MAX_TAG = 2**31

_live: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close communicators at interpreter exit, so peers see an orderly close."""
    for c in list(_live):
        try:
            c.close()
        except Exception:  # exiting anyway
            pass


# -- Work ---------------------------------------------------------------------------------


class Work:
    """The handle of an asynchronous operation."""

    __slots__ = ("_callbacks", "_event", "_exc", "_lock", "_timeout", "_what", "source")

    def __init__(self, timeout: float | None = None, what: str = "") -> None:
        # ``timeout``: the deadline of an operation that nothing else times out (a posted
        # receive); wait() without a timeout of its own gives up after it.
        self._timeout = timeout
        self._what = what
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Work], Any]] | None = []
        self.source: int | None = None

    def _finish(self, source: int | None = None) -> None:
        self.source = source
        self._complete()

    def _fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:
                log.exception("plait: a Work callback raised")

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until done; raise the operation's error, or CommTimeoutError if this wait's
        own ``timeout`` expires first (the operation keeps running)."""
        t = None if timeout is None else to_seconds(timeout, 0.0)
        if t is None and self._timeout is not None:
            if not self._event.wait(self._timeout):
                raise CommTimeoutError(f"{self._what}: not completed within the "
                                       f"communicator's timeout of {self._timeout:g} s")
        elif not self._event.wait(t):
            raise CommTimeoutError(f"Work.wait: not completed within {t:g} s (the operation "
                                   "is still running)")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._exc if self._event.is_set() else None

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Call ``fn(work)`` once when the work completes (at once if it has)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)


def _done_work(source: int | None = None) -> Work:
    w = Work()
    w._finish(source)
    return w


# -- channels -----------------------------------------------------------------------------


class _ShmChannel:
    def __init__(self, seg: shm.Segment, me: int, peer_local: int, peer: int,
                 cma_min: int) -> None:
        self.peer = peer
        self.me = me
        self.peer_local = peer_local
        self.ctl = seg.ctl
        self.out_ring = ShmRing(seg, shm.KIND_COLL, me, peer_local)
        self.in_ring = ShmRing(seg, shm.KIND_COLL, peer_local, me)
        self.peer_bell = seg.bells[peer_local]
        self.cma_min = cma_min if cma.AVAILABLE and seg.layout.local_size <= 63 else 0
        self.cma_checked = not self.cma_min

    def _verify_cma(self) -> None:
        """Trust the peer's addresses once we have read its nonce through them."""
        row = self.ctl[self.peer_local]
        pid, addr, nonce = int(row[shm.W_PID]), int(row[shm.W_NONCE_ADDR]), int(
            row[shm.W_NONCE])
        if not (pid and addr and nonce):
            return  # the peer has not attached yet: try again next time
        self.cma_checked = True
        if cma.read_word(pid, addr) == nonce:
            mine = self.ctl[self.me]
            mine[shm.W_CMA_FROM] = int(mine[shm.W_CMA_FROM]) | (1 << self.peer_local)

    def send(self, view: np.ndarray, ctx: OpCtx, idx: int) -> ShmSend:
        use_cma = bool(self.cma_min) and len(view) >= self.cma_min and bool(
            (int(self.ctl[self.peer_local, shm.W_CMA_FROM]) >> self.me) & 1)
        return ShmSend(self.peer, self.out_ring, view, ctx.seq, idx, self.peer_bell, use_cma)

    def recv(self, view: np.ndarray, reducer: Reducer | None, ctx: OpCtx, idx: int) -> ShmRecv:
        if not self.cma_checked:
            self._verify_cma()
        return ShmRecv(self.peer, self.in_ring, view, reducer, ctx.seq, idx, self.peer_bell,
                       ctx.where)


class _TcpChannel:
    def __init__(self, comm: Communicator, peer: int) -> None:
        self.comm = comm
        self.peer = peer
        self.inbox = comm._inbox(peer)

    def send(self, view: np.ndarray, ctx: OpCtx, idx: int) -> Any:
        out = self.comm._outbound(self.peer, ctx.deadline)
        if out.striper is not None and len(view) > out.max_frame:
            from .transport.streams import StripedSend

            return StripedSend(self.peer, out.striper, view, ctx.seq, idx, self.comm._bell)
        return TcpSend(self.peer, out, view, ctx.seq, idx)

    def recv(self, view: np.ndarray, reducer: Reducer | None, ctx: OpCtx, idx: int) -> TcpRecv:
        return TcpRecv(self.peer, self.inbox, view, reducer, ctx.seq, idx, ctx.where)


# -- init ---------------------------------------------------------------------------------


def init(rank: int | None = None, world_size: int | None = None, *, store: Any = None,
         timeout: float | datetime.timedelta | None = None) -> Communicator:
    """Join a job and return its world communicator.

    With no rank/size, they come from the launcher's variables (torchrun, Open MPI, PMI,
    Slurm: first match wins). ``store``: a torch.distributed Store; by default a TCPStore
    at MASTER_ADDR:MASTER_PORT (hosted by rank 0 unless torchrun's agent hosts it).
    """
    cfg = Config.from_env()
    timeout_s = to_seconds(timeout, cfg.timeout)
    if rank is None or world_size is None:
        r, s, _ = launcher_rank_size()
        rank = r if rank is None else rank
        world_size = s if world_size is None else world_size
    if not isinstance(rank, int) or not isinstance(world_size, int) or world_size < 1 \
            or not 0 <= rank < world_size:
        raise ValueError(f"plait.init: invalid rank {rank!r} for world size {world_size!r}")
    owned_store = store is None
    if store is None:
        store = store_from_env(rank, world_size, timeout_s)
    # Several communicators may be made on one store: each gets its own key prefix.
    count = int(store.add("plait/inits", 1))
    gen = (count - 1) // world_size
    prefix = f"plait/{gen}"
    if rank == 0:
        job = os.urandom(16)
        secret = _configured_secret(cfg) or os.urandom(32)
        payload = job if _configured_secret(cfg) else job + secret
        store.set(prefix + "/job", payload.hex())
    else:
        raw = bytes.fromhex(_get(store, prefix + "/job", timeout_s).decode())
        job = raw[:16]
        secret = _configured_secret(cfg) or raw[16:]
    return Communicator(rank=rank, size=world_size, store=store, prefix=prefix,
                        timeout=timeout_s, cfg=cfg, job=job, secret=secret,
                        owned_store=store if owned_store else None)


def _configured_secret(cfg: Config) -> bytes:
    if cfg.secret:
        return cfg.secret.encode()
    if cfg.secret_file:
        with open(cfg.secret_file, "rb") as f:
            return f.read().strip()
    return b""


def _get(store: Any, key: str, timeout_s: float) -> bytes:
    """store.get with our deadline (the store's own timeout may be shorter or longer)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        if store.check([key]):
            return bytes(store.get(key))
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"rendezvous: key {key!r} did not appear within "
                                   f"{timeout_s:g} s (did every rank join?)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# -- the communicator ---------------------------------------------------------------------


class Communicator:
    """A group of ranks that run collectives and point-to-point operations together."""

    def __init__(self, *, rank: int, size: int, store: Any, prefix: str, timeout: float,
                 cfg: Config, job: bytes, secret: bytes, owned_store: Any = None,
                 host_local_rank: int | None = None) -> None:
        self.rank = rank
        self.size = size
        # this process's local rank on its host in the job's world communicator: the rail
        # its TCP traffic uses, in sub-communicators too (topology/rails.py)
        self._host_local_rank = host_local_rank
        self.topology: topo_model.Topology | None = None
        self._ring: tuple[int, ...] = ()
        self._hier: Any = None  # algorithms.hier.Hier, made at the first hierarchical op
        self.timeout = timeout
        self._cfg = cfg
        self._store = store
        self._owned_store = owned_store
        self._prefix = prefix
        self._job = job
        self._secret = secret
        self._uid = hashlib.sha256(job + prefix.encode()).digest()[:16]
        self._closed = False
        self._broken: BaseException | None = None
        self._seq = 0
        self._split_seq = 0
        self._cv = threading.Condition(threading.Lock())
        self._red_cache: dict[tuple[Any, str], tuple[ReduceOp, Reducer]] = {}
        self._sel_cache: dict[tuple[str, int, int], str] = {}
        self._queue: deque[tuple[int, str, Callable[[OpCtx], None], Work]] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._seg: shm.Segment | None = None
        self._board: shm.SlotBoard | None = None
        self._hub: TcpHub | None = None
        self._inboxes: dict[int, CollInbox] = {}
        self._chan_cache: dict[int, Any] = {}
        self._tcp_addrs: dict[int, tuple[str, int]] = {}
        self._p2p = p2pmod.Engine(rank)
        self._p2p_lock = threading.Lock()
        self._drainer: p2pmod.Drainer | None = None
        self._shm_senders: dict[int, p2pmod.ShmSender] = {}
        self._send_queues: dict[int, _SendQueue] = {}
        self._lost: dict[int, BaseException] = {}
        self._next_liveness = 0.0
        # reliability (plait.health, plait.flightrec): the running op, what the last
        # _select/_buf saw (for the recorder), this rank's shm control words
        self._store_host: int | None = None
        self._cur_ctx: OpCtx | None = None
        self._op_nbytes = 0
        self._op_algo = ""
        self._op_dtype: Any = None
        self._my_ctl: memoryview | None = None
        self._peer_ids: list[tuple[str, int]] = []
        self._rec = FlightRecorder(cfg.flight_recorder_entries)
        self._health = Health(self)
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        if cfg.debug == "check":
            from . import check

            check.install(self)
        _live.add(self)

    # -- set-up ---------------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self._cfg
        deadline = time.monotonic() + self.timeout
        me_host = host_identity(cfg.host_id)
        # every rank's discovery info (topology/discover.py) travels with its host identity
        info = {**topo_discover.local_info(cfg.host_id, cfg.socket_ifname), "host": me_host,
                "pid": os.getpid(), "hlr": self._host_local_rank}
        self._store.set(f"{self._prefix}/info/{self.rank}", json.dumps(info))
        infos = [json.loads(_get(self._store, f"{self._prefix}/info/{r}", self.timeout))
                 for r in range(self.size)]
        self._hosts = [i["host"] for i in infos]
        self._peer_ids = [(i["host"], i["pid"]) for i in infos]  # plait.health: who is lost
        self.topology = topo_model.build(
            infos, topo_file.load(cfg.topo_file) if cfg.topo_file else None)
        self._ring = tuple(ring_order(self.topology))
        if cfg.transport == "tcp":
            local = [self.rank]
        else:
            local = [r for r in range(self.size) if self._hosts[r] == me_host]
        self._local_ranks = local
        self._local_index = {r: i for i, r in enumerate(local)}
        self._me_local = self._local_index[self.rank]
        if self._host_local_rank is None:  # a world communicator: its local rank picks the rail
            self._host_local_rank = self._me_local
        self.all_local = len(local) == self.size
        remote = [r for r in range(self.size) if r not in self._local_index]
        # Spin long enough that a peer a little behind is caught without a futex round
        # trip: with a short spin, two ranks fall into a pattern where each waits for the
        # other to wake up (measured here: 8-byte allreduce 13 us with a 2 ms spin, 150+ us
        # with 50 us under load). Oversubscribed, spin by yielding the core.
        self._oversubscribed = len(local) > cpu_count()
        spin = cfg.spin_us if cfg.spin_us >= 0 else (500.0 if self._oversubscribed else 2000.0)
        self._spin_s = spin * 1e-6
        if len(local) > 1:
            host_index = sorted(set(self._hosts)).index(me_host)
            layout = shm.Layout(len(local), cfg.shm_slot_size, cfg.shm_chunk_size,
                                cfg.shm_ring_chunks)
            name = f"plait-{self._uid.hex()[:20]}-{host_index}-{os.getuid()}"
            fail_key = f"{self._prefix}/shmfail/{host_index}"
            if self._me_local == 0:
                self._seg = shm.create(name, layout, 0)
                try:
                    polls = 0
                    while not self._seg.ctl[:, shm.W_ATTACHED].all():
                        polls += 1
                        if polls % 50 == 0 and self._store.check([fail_key]):
                            raise PlaitError(f"rank {self.rank}, init: a local rank could not "
                                             "attach to shared memory: "
                                             f"{self._store.get(fail_key).decode()}")
                        if time.monotonic() > deadline:
                            att = self._seg.ctl[:, shm.W_ATTACHED]
                            missing = [r for i, r in enumerate(local) if not att[i]]
                            raise CommTimeoutError(
                                f"rank {self.rank}, init: local ranks {missing} did not "
                                "attach to shared memory in time")
                        time.sleep(0.0002)
                finally:
                    shm.unlink(name)
            else:
                try:
                    self._seg = shm.attach(name, layout, self._me_local, deadline)
                except PlaitError as exc:
                    # tell the creator at once, so it unlinks instead of waiting for us
                    self._store.set(fail_key, f"rank {self.rank}: {exc}")
                    raise
            self._bell = self._seg.bells[self._me_local]
            self._p2p_bell = self._seg.p2p_bells[self._me_local]
            self._my_ctl = memoryview(self._seg.ctl[self._me_local])
        else:
            self._bell = private_bell()
            self._p2p_bell = private_bell()
        self._waiter = Waiter(self._bell, self._spin_s, self._check_alive,
                              yield_cpu=self._oversubscribed)
        if self._seg is not None and self.all_local:
            self._board = shm.SlotBoard(self._seg, self._waiter.wait)
        self._situation = selector.situation(self.size, self.all_local and self.size > 1,
                                             bool(remote), cfg.shm_slot_size, self.topology,
                                             cfg.transport != "tcp")
        if remote:
            host, bind_src = rail_address(self.topology, self.rank, self._host_local_rank,
                                          cfg.socket_ifname, self._store)
            self._hub = TcpHub(rank=self.rank, job=self._job, comm_uid=self._uid,
                               secret=self._secret, bind_host=host,
                               max_frame=cfg.tcp_chunk_size, on_frame=self._on_frame,
                               on_peer_lost=self._on_peer_lost, nsocks=cfg.nsocks,
                               bind_source=bind_src)
            self._store.set(f"{self._prefix}/tcp/{self.rank}",
                            f"{self._hub.address[0]}:{self._hub.address[1]}")
        log.debug("rank %d: communicator %s of %d ranks, %d local", self.rank, self._prefix,
                  self.size, len(local))

    def _hierarchy(self) -> Any:
        """The sub-communicators of hierarchical operations (algorithms/hier.py), made at
        the first one: every rank runs the same operations in the same order."""
        if self._hier is None:
            from .algorithms.hier import Hier

            self._hier = Hier(self)
        return self._hier

    def _inbox(self, peer: int) -> CollInbox:
        box = self._inboxes.get(peer)
        if box is None:
            box = self._inboxes.setdefault(peer, CollInbox(peer, self._bell))
            if peer in self._lost:
                box.fail(self._lost[peer])
        return box

    def _outbound(self, peer: int, deadline: float) -> Outbound:
        assert self._hub is not None
        out = self._hub.outbound.get(peer)
        if out is not None:
            return out
        addr = self._tcp_addrs.get(peer)
        if addr is None:
            raw = _get(self._store, f"{self._prefix}/tcp/{peer}",
                       max(0.001, deadline - time.monotonic())).decode()
            host, _, port = raw.rpartition(":")
            addr = self._tcp_addrs[peer] = (host, int(port))
        return self._hub.connect(peer, addr, deadline)

    def _channels(self, peer: int, ctx: OpCtx) -> Any:
        ch = self._chan_cache.get(peer)
        if ch is None:
            if peer in self._local_index:
                assert self._seg is not None
                ch = _ShmChannel(self._seg, self._me_local, self._local_index[peer], peer,
                                 self._cfg.cma_min_size)
            else:
                ch = _TcpChannel(self, peer)
            self._chan_cache[peer] = ch
        return ch

    def _on_frame(self, peer: int, f: wire.Frame, sock: Any) -> None:
        if f.kind == wire.KIND_COLL:
            self._inbox(peer).deliver(f, sock)
        else:
            self._p2p.on_frame(peer, f, lambda dst: recv_exact_into(sock, memoryview(dst)))

    def _on_peer_lost(self, peer: int, cause: BaseException | None) -> None:
        exc = peer_lost_error(self.rank, peer, cause)
        # a peer that gave up because of another rank's failure closes its connections
        # right after publishing the abort notice: name the rank that failed
        exc = self._health.explain_loss(peer, exc)
        self._lost[peer] = exc
        self._inbox(peer).fail(exc)
        self._p2p.peer_failed(peer, exc)

    def _check_alive(self) -> None:
        """Called by waits between sleeps: fail fast if closed, a local peer died, or
        another rank published an abort notice (see plait.health)."""
        self._health.check()

    # -- public helpers -------------------------------------------------------------------

    def peer_transport(self, rank: int) -> str:
        """Which transport this rank uses to reach ``rank``: "shm" or "tcp"."""
        self._check_rank(rank, "peer_transport", "rank")
        return "shm" if rank in self._local_index else "tcp"

    def __repr__(self) -> str:
        return (f"<plait.Communicator rank {self.rank} of {self.size}, "
                f"{len(self._local_ranks)} local{', closed' if self._closed else ''}>")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sequencing -----------------------------------------------------------------------

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}, {op}: the communicator is closed")
        if self._broken is not None:
            raise PlaitError(f"rank {self.rank}, {op}: the communicator is unusable after an "
                             f"earlier failure: {self._broken}") from self._broken

    def _submit(self, name: str, fn: Callable[[OpCtx], None], async_op: bool) -> Work | None:
        with self._cv:
            self._check_usable(name)
            self._seq += 1
            seq = self._seq
            # flight recorder: no lock of its own, no formatting (see plait.flightrec)
            slot = [seq, name, self._op_nbytes, self._op_dtype, self._op_algo, 0.0, 0.0, 0.0,
                    None]
            self._rec.slots[seq & self._rec.mask] = slot
            self._op_dtype = None
            if not async_op and not self._busy and not self._queue:
                self._busy = True
                work = None
            else:
                slot[ISSUED] = time.monotonic()  # a synchronous op is issued as it starts
                work = Work()
                self._queue.append((seq, name, fn, work))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                    name=f"plait-progress-r{self.rank}")
                    self._thread.start()
                self._cv.notify_all()
        if work is None:
            try:
                self._execute(name, seq, fn)
            finally:
                with self._cv:
                    self._busy = False
                    if self._queue:
                        self._cv.notify_all()
            return None
        if async_op:
            return work
        work.wait()
        return None

    def _execute(self, name: str, seq: int, fn: Callable[[OpCtx], None]) -> None:
        if self._broken is not None:
            self._check_usable(name)
        t0 = time.monotonic()
        ctx = OpCtx(self, name, seq, t0 + self.timeout)
        self._cur_ctx = ctx
        slot = self._rec.slots[seq & self._rec.mask]
        slot[STARTED] = t0  # type: ignore[index]
        try:
            fn(ctx)
        except BaseException as exc:
            # a peer failure raised by a sub-communicator names its ranks: name ours
            err = self._health.adopt(exc, ctx)
            slot[ERROR] = f"{type(err).__name__}: {err}"  # type: ignore[index]
            if isinstance(err, (PlaitError, OSError)) and not isinstance(err, ClosedError):
                self._broken = err
                self._health.on_failure(err)
            if err is exc:
                raise
            raise err from exc
        slot[ENDED] = time.monotonic()  # type: ignore[index]
        mine = self._my_ctl  # for a peer's timeout report (W_OP_SEQ: see plait.health)
        if mine is not None:
            mine[shm.W_OP_DONE] = seq
        if self._health.status_seq == seq:  # it said "waiting" in the store: now done
            self._health.done(name, seq)

    def _progress_loop(self) -> None:
        while True:
            with self._cv:
                while (self._busy or not self._queue) and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                seq, name, fn, work = self._queue.popleft()
                self._busy = True
            try:
                self._execute(name, seq, fn)
            except BaseException as exc:
                work._fail(exc)
            else:
                work._finish()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    # -- validation helpers ---------------------------------------------------------------

    def _check_rank(self, r: Any, op: str, what: str) -> int:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < self.size:
            raise ValueError(f"rank {self.rank}, {op}: {what} {r!r} is not a rank of this "
                             f"communicator (0..{self.size - 1})")
        return int(r)

    def _buf(self, obj: Any, op: str, arg: str, writable: bool = False) -> Buf:
        b = as_buf(obj, rank=self.rank, op=op, arg=arg, writable=writable)
        self._op_dtype = b.dtype  # for the flight recorder
        return b

    def _reducer(self, op: Any, b: Buf, name: str) -> tuple[ReduceOp, Reducer]:
        try:
            key = (op, b.dtype.name)
            hit = self._red_cache.get(key)
        except TypeError:  # an unhashable op object
            key, hit = None, None
        if hit is not None:
            return hit
        rop = ReduceOp.parse(op, rank=self.rank, opname=name)
        pair = rop, b.dtype.reducer(rop, rank=self.rank, opname=name)
        if key is not None:
            self._red_cache[key] = pair
        return pair

    def _counts(self, counts: Any, op: str, what: str) -> tuple[int, ...]:
        try:
            out = tuple(int(c) for c in counts)
        except (TypeError, ValueError):
            raise TypeError(f"rank {self.rank}, {op}: {what} must be a sequence of integers") \
                from None
        if len(out) != self.size:
            raise ValueError(f"rank {self.rank}, {op}: {what} has {len(out)} entries, expected "
                             f"one per rank ({self.size})")
        if any(c < 0 for c in out):
            raise ValueError(f"rank {self.rank}, {op}: {what} has a negative count")
        return out

    def _select(self, op: str, nbytes: int, slot_bytes: int) -> str:
        key = (op, nbytes, slot_bytes)
        algo = self._sel_cache.get(key)
        if algo is None:
            algo = selector.select(op, nbytes, slot_bytes, self._situation, self._cfg.algo)
            if len(self._sel_cache) > 4096:
                self._sel_cache.clear()
            self._sel_cache[key] = algo
        self._op_nbytes = nbytes  # for the flight recorder
        self._op_algo = algo
        return algo

    def _run(self, ctx: OpCtx, sched: Schedule, inbuf: np.ndarray | None,
             outbuf: np.ndarray | None, reducer: Reducer | None, storage: np.dtype) -> None:
        run(self, ctx, sched, inbuf, outbuf, reducer, storage)

    # -- collectives ----------------------------------------------------------------------

    def allreduce(self, buf: Any, op: Any = "sum", *, async_op: bool = False) -> Work | None:
        """Reduce ``buf`` over all ranks, in place: every rank gets the result."""
        b = self._buf(buf, "allreduce", "buf", writable=True)
        rop, reducer = self._reducer(op, b, "allreduce")
        algo = self._select("allreduce", b.nbytes, b.nbytes)
        arr = b.arr
        n = self.size

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.allreduce(self._board, ctx, arr, reducer)
            elif algo == "hier":
                self._hierarchy().allreduce(b, rop)
            elif algo == "ring" and self._ring != tuple(range(n)):
                # the ring follows the topology: ranks of a host, hosts of a switch adjacent
                self._run(ctx, ring_allreduce(self.rank, n, b.count, self._ring), arr, arr,
                          reducer, arr.dtype)
            elif n > 1:
                mod = allreduce_ring if algo == "ring" else allreduce_rd
                self._run(ctx, mod.schedule(self.rank, n, b.count), arr, arr, reducer,
                          arr.dtype)
            if rop is ReduceOp.AVG:
                divide(arr, b.dtype, n)

        return self._submit("allreduce", fn, async_op)

    def reduce(self, buf: Any, root: int, op: Any = "sum", *, async_op: bool = False
               ) -> Work | None:
        """Reduce ``buf`` over all ranks into ``buf`` on ``root``; others' buf is unchanged."""
        root = self._check_rank(root, "reduce", "root")
        b = self._buf(buf, "reduce", "buf", writable=self.rank == root)
        rop, reducer = self._reducer(op, b, "reduce")
        algo = self._select("reduce", b.nbytes, b.nbytes)
        arr = b.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.reduce(self._board, ctx, arr, reducer, root)
            elif self.size > 1:
                self._run(ctx, reduce_tree.schedule(self.rank, self.size, b.count, root), arr,
                          arr, reducer, arr.dtype)
            if rop is ReduceOp.AVG and self.rank == root:
                divide(arr, b.dtype, self.size)

        return self._submit("reduce", fn, async_op)

    def broadcast(self, buf: Any, root: int, *, async_op: bool = False) -> Work | None:
        """Copy ``buf`` of ``root`` into ``buf`` of every rank."""
        root = self._check_rank(root, "broadcast", "root")
        b = self._buf(buf, "broadcast", "buf", writable=self.rank != root)
        algo = self._select("broadcast", b.nbytes, b.nbytes)
        arr = b.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.broadcast(self._board, ctx, arr, root)
            elif algo == "hier":
                self._hierarchy().broadcast(b, root)
            elif self.size > 1:
                if algo == "chain":
                    # Pieces pipeline the chain; each costs a step (a round trip), so keep
                    # them large. Two ranks have nothing to pipeline: one message.
                    piece = max(1 << 20, b.nbytes // 64)
                    pieces = 1 if self.size == 2 else max(1, b.nbytes // piece)
                    sched = broadcast_chain.schedule(self.rank, self.size, b.count, root,
                                                     pieces)
                else:
                    sched = broadcast_tree.schedule(self.rank, self.size, b.count, root)
                self._run(ctx, sched, arr, arr, None, arr.dtype)

        return self._submit("broadcast", fn, async_op)

    def allgather(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = False) -> Work | None:
        """Every rank's ``sendbuf``, rank-major, into every rank's ``recvbuf``."""
        s = self._buf(sendbuf, "allgather", "sendbuf")
        r = self._buf(recvbuf, "allgather", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="allgather")
        expect_count(r, self.size * s.count, rank=self.rank, op="allgather", arg="recvbuf",
                     why=f"{self.size} ranks x {s.count} elements of sendbuf")
        return self._allgatherv("allgather", s, r, (s.count,) * self.size, async_op)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                   async_op: bool = False) -> Work | None:
        """Like allgather, with ``counts[i]`` elements from rank i."""
        s = self._buf(sendbuf, "allgatherv", "sendbuf")
        r = self._buf(recvbuf, "allgatherv", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="allgatherv")
        cnt = self._counts(counts, "allgatherv", "counts")
        expect_count(s, cnt[self.rank], rank=self.rank, op="allgatherv", arg="sendbuf",
                     why=f"counts[{self.rank}]")
        expect_count(r, sum(cnt), rank=self.rank, op="allgatherv", arg="recvbuf",
                     why="the sum of counts")
        return self._allgatherv("allgatherv", s, r, cnt, async_op)

    def _allgatherv(self, name: str, s: Buf, r: Buf, cnt: tuple[int, ...], async_op: bool
                    ) -> Work | None:
        item = s.dtype.itemsize
        algo = self._select(name, r.nbytes, max(cnt) * item)
        sarr, rarr = s.arr, r.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.allgatherv(self._board, ctx, sarr, rarr, cnt)
                return
            if algo == "hier":
                self._hierarchy().allgatherv(s, r, cnt)
                return
            if algo == "bruck":
                sched = allgather_bruck.schedule(self.rank, self.size, cnt)
            else:
                sched = allgather_ring.schedule(self.rank, self.size, cnt)
            self._run(ctx, sched, sarr, rarr, None, rarr.dtype)

        return self._submit(name, fn, async_op)

    def gather(self, sendbuf: Any, recvbuf: Any, root: int, *, async_op: bool = False
               ) -> Work | None:
        """Every rank's ``sendbuf``, rank-major, into ``recvbuf`` on ``root``."""
        root = self._check_rank(root, "gather", "root")
        s = self._buf(sendbuf, "gather", "sendbuf")
        rarr = None
        if self.rank == root:
            if recvbuf is None:
                raise ValueError(f"rank {self.rank}, gather: recvbuf is required on the root")
            r = self._buf(recvbuf, "gather", "recvbuf", writable=True)
            same_dtype(s, r, rank=self.rank, op="gather")
            expect_count(r, self.size * s.count, rank=self.rank, op="gather", arg="recvbuf",
                         why=f"{self.size} ranks x {s.count} elements of sendbuf")
            rarr = r.arr
        algo = self._select("gather", s.nbytes * self.size, s.nbytes)
        sarr = s.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.gather(self._board, ctx, sarr, rarr, root)
            else:
                sched = gather_linear.gather(self.rank, self.size, s.count, root)
                self._run(ctx, sched, sarr, rarr, None, sarr.dtype)

        return self._submit("gather", fn, async_op)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, *, async_op: bool = False
                ) -> Work | None:
        """Block i of ``sendbuf`` on ``root`` into ``recvbuf`` of rank i."""
        root = self._check_rank(root, "scatter", "root")
        r = self._buf(recvbuf, "scatter", "recvbuf", writable=True)
        sarr = None
        if self.rank == root:
            if sendbuf is None:
                raise ValueError(f"rank {self.rank}, scatter: sendbuf is required on the root")
            s = self._buf(sendbuf, "scatter", "sendbuf")
            same_dtype(s, r, rank=self.rank, op="scatter")
            expect_count(s, self.size * r.count, rank=self.rank, op="scatter", arg="sendbuf",
                         why=f"{self.size} ranks x {r.count} elements of recvbuf")
            sarr = s.arr
        algo = self._select("scatter", r.nbytes * self.size, r.nbytes * self.size)
        rarr = r.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.scatter(self._board, ctx, sarr, rarr, root)
            else:
                sched = gather_linear.scatter(self.rank, self.size, r.count, root)
                self._run(ctx, sched, sarr, rarr, None, rarr.dtype)

        return self._submit("scatter", fn, async_op)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                       async_op: bool = False) -> Work | None:
        """Block i of the reduction of every rank's ``sendbuf`` into ``recvbuf`` of rank i."""
        s = self._buf(sendbuf, "reduce_scatter", "sendbuf")
        r = self._buf(recvbuf, "reduce_scatter", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="reduce_scatter")
        expect_count(s, self.size * r.count, rank=self.rank, op="reduce_scatter",
                     arg="sendbuf", why=f"{self.size} ranks x {r.count} elements of recvbuf")
        rop, reducer = self._reducer(op, s, "reduce_scatter")
        algo = self._select("reduce_scatter", s.nbytes, s.nbytes)
        sarr, rarr = s.arr, r.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.reduce_scatter(self._board, ctx, sarr, rarr, reducer)
            elif algo == "hier":
                self._hierarchy().reduce_scatter(s, r, rop)
            else:
                sched = reduce_scatter_ring.schedule(self.rank, self.size,
                                                     (r.count,) * self.size)
                self._run(ctx, sched, sarr, rarr, reducer, rarr.dtype)
            if rop is ReduceOp.AVG:
                divide(rarr, r.dtype, self.size)

        return self._submit("reduce_scatter", fn, async_op)

    def alltoall(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = False) -> Work | None:
        """Block j of ``sendbuf`` of rank i into block i of ``recvbuf`` of rank j."""
        s = self._buf(sendbuf, "alltoall", "sendbuf")
        r = self._buf(recvbuf, "alltoall", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="alltoall")
        if s.count % self.size:
            raise ValueError(f"rank {self.rank}, alltoall: sendbuf has {s.count} elements, not "
                             f"a multiple of the {self.size} ranks")
        expect_count(r, s.count, rank=self.rank, op="alltoall", arg="recvbuf",
                     why="the same as sendbuf")
        c = s.count // self.size
        return self._alltoallv("alltoall", s, (c,) * self.size, r, (c,) * self.size, async_op)

    def alltoallv(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any,
                  recv_counts: Sequence[int], *, async_op: bool = False) -> Work | None:
        """Like alltoall with ``send_counts[j]`` elements to rank j and ``recv_counts[i]``
        from rank i (blocks packed in rank order)."""
        s = self._buf(sendbuf, "alltoallv", "sendbuf")
        r = self._buf(recvbuf, "alltoallv", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="alltoallv")
        sc = self._counts(send_counts, "alltoallv", "send_counts")
        rc = self._counts(recv_counts, "alltoallv", "recv_counts")
        expect_count(s, sum(sc), rank=self.rank, op="alltoallv", arg="sendbuf",
                     why="the sum of send_counts")
        expect_count(r, sum(rc), rank=self.rank, op="alltoallv", arg="recvbuf",
                     why="the sum of recv_counts")
        return self._alltoallv("alltoallv", s, sc, r, rc, async_op)

    def _alltoallv(self, name: str, s: Buf, sc: tuple[int, ...], r: Buf, rc: tuple[int, ...],
                   async_op: bool) -> Work | None:
        algo = self._select(name, s.nbytes, s.nbytes)
        sarr, rarr = s.arr, r.arr

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.alltoall(self._board, ctx, sarr, rarr)
            elif algo == "hier":
                self._hierarchy().alltoallv(s, sc, r, rc, uniform=name == "alltoall")
            else:
                sched = alltoall_pairwise.schedule(self.rank, self.size, sc, rc)
                self._run(ctx, sched, sarr, rarr, None, rarr.dtype)

        return self._submit(name, fn, async_op)

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Return once every rank has entered the barrier."""
        algo = self._select("barrier", 0, 0)

        def fn(ctx: OpCtx) -> None:
            if algo == "direct":
                assert self._board is not None
                direct.barrier(self._board, ctx)
            elif self.size > 1:
                empty = np.empty(0, dtype=np.uint8)
                self._run(ctx, barrier_dissemination.schedule(self.rank, self.size), empty,
                          empty, None, empty.dtype)

        return self._submit("barrier", fn, async_op)

    # -- point to point -------------------------------------------------------------------

    def _check_tag(self, tag: Any, op: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) \
                or not 0 <= tag < MAX_TAG:
            raise ValueError(f"rank {self.rank}, {op}: tag {tag!r} must be an int in "
                             f"[0, 2**31)")
        return int(tag)

    def _start_p2p(self) -> None:
        if self._drainer is not None or self._seg is None:
            return
        with self._p2p_lock:
            if self._drainer is not None:
                return
            seg = self._seg
            rings = [(r, ShmRing(seg, shm.KIND_P2P, self._local_index[r], self._me_local),
                      seg.p2p_bells[self._local_index[r]])
                     for r in self._local_ranks if r != self.rank]
            self._drainer = p2pmod.Drainer(self._p2p, rings, self._p2p_bell, self._spin_s,
                                           f"plait-p2p-r{self.rank}")

    def send(self, buf: Any, dst: int, tag: int = 0, *, async_op: bool = False) -> Work | None:
        """Send ``buf`` to ``dst``; returns when ``buf`` may be reused."""
        op = "isend" if async_op else "send"
        self._check_usable(op)
        dst = self._check_rank(dst, op, "dst")
        tag = self._check_tag(tag, op)
        b = self._buf(buf, op, "buf")
        data = b.bytes()
        if dst == self.rank:
            self._p2p.deliver_local(tag, data.copy())
            return _done_work() if async_op else None
        self._start_p2p()
        q = self._send_queues.get(dst)
        if q is None:
            with self._p2p_lock:
                q = self._send_queues.setdefault(dst, _SendQueue(self, dst))
        return q.submit(lambda: self._send_now(dst, tag, data, op), async_op)

    def _send_now(self, dst: int, tag: int, data: np.ndarray, op: str) -> None:
        deadline = time.monotonic() + self.timeout
        if dst in self._local_index:
            sender = self._shm_senders.get(dst)
            if sender is None:
                assert self._seg is not None
                pl = self._local_index[dst]
                sender = self._shm_senders.setdefault(dst, p2pmod.ShmSender(
                    self._seg, self._me_local, pl, dst, self._p2p_bell, self._seg.p2p_bells[pl]))
            seq = self._seq
            ctx = OpCtx(self, op, seq, deadline)
            p2p_waiter = Waiter(self._p2p_bell, self._spin_s, self._check_alive)

            def wait_space(ready: Callable[[], bool]) -> None:
                p2p_waiter.wait(ready, ctx, lambda: f"rank {dst} to receive")

            sender.send(tag, data, wait_space)
        else:
            if dst in self._lost:
                raise self._lost[dst]
            out = self._outbound(dst, deadline)
            with out.lock:
                seq = out.p2p_seq
                out.p2p_seq += 1
            out.send_message(wire.KIND_P2P, tag, seq, data)

    def recv(self, buf: Any, src: int | None = None, tag: int = 0, *, async_op: bool = False
             ) -> Any:
        """Receive into ``buf`` from ``src`` (any rank if None); returns the source rank
        (or a Work whose ``source`` is set when async)."""
        op = "irecv" if async_op else "recv"
        self._check_usable(op)
        if src is not None:
            src = self._check_rank(src, op, "src")
        tag = self._check_tag(tag, op)
        b = self._buf(buf, op, "buf", writable=True)
        self._start_p2p()
        who = "any rank" if src is None else f"rank {src}"
        where = f"rank {self.rank}, {op}"
        work = Work(self.timeout, f"{where} from {who} with tag {tag}")
        self._p2p.post(p2pmod.Recv(b.bytes(), src, tag, work, where))
        if async_op:
            return work
        work.wait()
        return work.source

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        w = self.send(buf, dst, tag, async_op=True)
        assert w is not None
        return w

    def irecv(self, buf: Any, src: int | None = None, tag: int = 0) -> Work:
        w = self.recv(buf, src, tag, async_op=True)
        assert isinstance(w, Work)
        return w

    # -- split ----------------------------------------------------------------------------

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Collective over this communicator: ranks with equal ``color`` form a new
        communicator, ordered by (key, rank here); ``color=None`` gets None."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise ValueError(f"rank {self.rank}, split: color must be a non-negative int or "
                             f"None, not {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise ValueError(f"rank {self.rank}, split: key must be an int, not {key!r}")
        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        everyone = np.empty(2 * self.size, dtype=np.int64)
        self.allgather(mine, everyone)
        self._split_seq += 1
        if color is None:
            return None
        pairs = everyone.reshape(self.size, 2)
        members = sorted((int(pairs[r, 1]), r) for r in range(self.size)
                         if pairs[r, 0] == color)
        ranks = [r for _, r in members]
        prefix = f"{self._prefix}/split{self._split_seq}/c{color}"
        return Communicator(rank=ranks.index(self.rank), size=len(ranks), store=self._store,
                            prefix=prefix, timeout=self.timeout, cfg=self._cfg, job=self._job,
                            secret=self._secret, host_local_rank=self._host_local_rank)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Free this rank's resources (local). Later calls raise ClosedError. Closing
        while collectives are queued or running aborts them (see ``abort``)."""
        self._stop(aborted=False)

    def abort(self) -> None:
        """Stop at once: this rank's pending operations fail with ClosedError, every other
        rank waiting in an operation of this communicator fails with PeerFailedError
        naming this rank (within about 0.5 s), and resources are released as by close()."""
        self._stop(aborted=True)

    def flight_record(self) -> list[dict[str, Any]]:
        """The flight recorder's view of the last collectives, oldest first: seq, op,
        bytes, dtype, algorithm, state (queued/running/done/failed), wall-clock issued/
        started/ended times, duration_us, error (see plait.flightrec)."""
        return self._rec.records()

    def _stop(self, aborted: bool) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            pending = list(self._queue)
            self._queue.clear()
            running = self._busy
        what = "aborted" if aborted else "closed"
        if aborted or pending or running:
            self._health.publish(self.rank, f"rank {self.rank} {what} its communicator with "
                                 f"{len(pending) + running} collective(s) pending", "aborted")
        exc = ClosedError(f"rank {self.rank}: the communicator was {what}")
        for _, _, _, work in pending:
            work._fail(exc)
        self._bell.ring()  # a waiting operation sees _closed at once
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        end = time.monotonic() + 5  # a synchronous operation on another thread: let it
        while self._busy and time.monotonic() < end \
                and self._thread is not threading.current_thread():  # leave the segment first
            time.sleep(0.002)
        self._p2p.fail_all(exc)
        self._teardown()

    def _teardown(self) -> None:
        if self._hier is not None:
            hier, self._hier = self._hier, None
            hier.close()
        for q in list(self._send_queues.values()):
            q.close()
        if self._drainer is not None:
            self._drainer.close()
            self._drainer = None
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        if self._seg is not None:
            seg = self._seg
            seg.ctl[seg.me, shm.W_CLOSED] = 1
            # Drop every view into the segment: Python 3.11's mmap keeps a duplicate of the
            # file descriptor until it is closed, and it can close only with no view alive.
            self._chan_cache.clear()
            self._shm_senders.clear()
            self._inboxes.clear()
            self._board = None
            self._seg = None
            self._bell = self._p2p_bell = private_bell()
            self._waiter = Waiter(self._bell, 0.0, self._check_alive)
            self._my_ctl = None
            if not seg.close():
                # A failed operation's traceback (kept by _broken, or by the caller who
                # caught it) holds the frames' views into the segment: drop their locals.
                for exc in (self._broken, self._health.failure):
                    if exc is not None and exc.__traceback__ is not None:
                        traceback.clear_frames(exc.__traceback__)
                gc.collect()
                seg.close()
        self._owned_store = None
        self._store = None

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


class _SendQueue:
    """Keeps sends to one peer in order; async sends progress on a thread of their own so
    that a send waiting for a slow receiver never holds up others."""

    def __init__(self, comm: Communicator, peer: int) -> None:
        self.comm = comm
        self.peer = peer
        self.cv = threading.Condition()
        self.items: deque[tuple[Callable[[], None], Work]] = deque()
        self.busy = False
        self.closed = False
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None], async_op: bool) -> Work | None:
        with self.cv:
            if not async_op and not self.busy and not self.items:
                self.busy = True
                inline = True
            else:
                inline = False
                work = Work()
                self.items.append((fn, work))
                if self.thread is None:
                    self.thread = threading.Thread(target=self._loop, daemon=True,
                                                   name=f"plait-send-r{self.comm.rank}-{self.peer}")
                    self.thread.start()
                self.cv.notify_all()
        if inline:
            try:
                fn()
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()
            return None
        if async_op:
            return work
        work.wait()
        return None

    def _loop(self) -> None:
        while True:
            with self.cv:
                while (self.busy or not self.items) and not self.closed:
                    self.cv.wait()
                if not self.items:
                    return
                fn, work = self.items.popleft()
                self.busy = True
            try:
                fn()
            except BaseException as exc:
                work._fail(exc)
            else:
                work._finish()
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            items = list(self.items)
            self.items.clear()
            self.cv.notify_all()
        for _, w in items:
            w._fail(ClosedError(f"rank {self.comm.rank}: the communicator was closed"))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
