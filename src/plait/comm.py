"""The Communicator: plait's public API on numpy arrays and torch CPU tensors.

A facade and nothing else: every public method validates its arguments (errors name the
rank, the operation and the problem, before any communication), describes the operation
as a ``Call`` and hands it to ``_launch``, which asks the selector for an algorithm
(algorithms/registry.py) and submits it in issue order (plait.progress). The parts it is
made of have interfaces of their own:

- ``membership.Group``: who is in it (immutable); ``membership.Origin``: what it was
  derived from (store keys, job, settings, failure scope);
- ``fabric.Fabric``: its transports, a channel per peer, the doorbell, the host collective;
- ``progress.Sequencer``: sequence numbers, the progress thread, ``Work``;
- ``health.Health``: failure state and notices; ``p2p.PointToPoint``: send and receive.

Every derived communicator (``split``, hier's sub-communicators, ``shrink``) is made the
same way, by ``_derive``: through the store, with an explicit parent and failure scope.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import json
import logging
import os
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .algorithms import registry
from .algorithms.hier import Hier
from .args import check_rank, check_split, check_tag
from .calls import Call, Calls, storage
from .config import SETTINGS, Config, apply_log_level, disagreement, to_seconds
from .errors import ClosedError, MismatchError
from .executor import Plans, Waiter, run, wait_reqs
from .fabric import Fabric, local_info
from .fastpath import FastPath
from .flightrec import FlightRecorder
from .health import Health
from .membership import ALL, MEMBERS, Group, Origin
from .p2p import PointToPoint
from .progress import Sequencer
from .rendezvous import Meeting, key_prefix, launcher_rank_size, store_from_env, wait_key
from .shrink import ShrinkResult, shrink_communicator
from .transport.base import OpCtx
from .transport.futex import private_bell
from .tuning import selector
from .work import Work, done_work

log = logging.getLogger("plait")

_live: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close communicators at interpreter exit, so peers see an orderly close."""
    for c in list(_live):
        try:
            c.close()
        except Exception:  # exiting anyway
            pass


# -- init ---------------------------------------------------------------------------------


def init(rank: int | None = None, world_size: int | None = None, *, store: Any = None,
         timeout: float | datetime.timedelta | None = None,
         config: Config | None = None) -> Communicator:
    """Join a job and return its world communicator.

    With no rank/size, they come from the launcher's variables (torchrun, Open MPI, PMI,
    Slurm: first match wins). ``store``: a torch.distributed Store; by default a TCPStore
    at MASTER_ADDR:MASTER_PORT (hosted by rank 0 unless torchrun's agent hosts it).
    ``config``: settings that win over ``PLAIT_*`` variables (``plait.Config``).
    """
    cfg = Config.resolve(config)
    apply_log_level(cfg)
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
    prefix = key_prefix(store, rank, world_size)
    if rank == 0:
        job = os.urandom(16)
        secret = _configured_secret(cfg) or os.urandom(32)
        payload = job if _configured_secret(cfg) else job + secret
        store.set(prefix + "/job", payload.hex())
    else:
        raw = bytes.fromhex(wait_key(store, prefix + "/job", timeout_s).decode())
        job = raw[:16]
        secret = _configured_secret(cfg) or raw[16:]
    origin = Origin(meet=Meeting(store, prefix), job=job, secret=secret, timeout=timeout_s,
                    cfg=cfg, owned_store=store if owned_store else None)
    return Communicator(origin, rank, world_size)


def _configured_secret(cfg: Config) -> bytes:
    if cfg.secret:
        return cfg.secret.encode()
    if cfg.secret_file:
        with open(cfg.secret_file, "rb") as f:
            return f.read().strip()
    return b""


def _rendezvous(origin: Origin, rank: int, size: int, deadline: float) -> list[dict[str, Any]]:
    """Every rank's info, through the store; settings that must agree are checked here,
    before any transport is opened."""
    cfg = origin.cfg
    mine = {**local_info(cfg, origin.host_local_rank), "agree": cfg.agreement()}
    meet = origin.meet
    meet.set(f"info/{rank}", json.dumps(mine))
    infos = [json.loads(meet.get(f"info/{r}", max(0.001, deadline - time.monotonic())))
             for r in range(size)]
    for r, info in enumerate(infos):
        name = disagreement(mine["agree"], info.get("agree", {}))
        if name is not None:
            env = SETTINGS[name].env
            raise MismatchError(
                f"rank {rank}, init: setting {env} must be the same on every rank: this "
                f"rank has {mine['agree'].get(name)}, rank {r} has "
                f"{info.get('agree', {}).get(name)}")
    return infos


# -- the communicator ---------------------------------------------------------------------


class Communicator:
    """A group of ranks that run collectives and point-to-point operations together."""

    def __init__(self, origin: Origin, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.timeout = origin.timeout
        self._origin = origin
        self._cfg = origin.cfg
        self._closed = False
        self._split_seq = 0
        self._shrink_gen = 0
        self._hier: Hier | None = None
        self._children: weakref.WeakSet[Communicator] = weakref.WeakSet()
        self._calls = Calls(rank, size)
        self._fabric: Fabric | None = None
        deadline = time.monotonic() + self.timeout
        infos = _rendezvous(origin, rank, size, deadline)
        self._group = g = Group.from_infos(rank, infos, self._cfg, origin.host_local_rank)
        uid = hashlib.sha256(origin.job + origin.meet.prefix.encode()).digest()[:16]
        self._uid = uid
        self._rec = FlightRecorder(self._cfg.flight_recorder_entries)
        lost: dict[int, BaseException] = {}
        self._health = health = Health(
            group=g, meet=origin.meet, scope=origin.scope, recorder=self._rec,
            timeout=self.timeout, flight_dir=self._cfg.flight_recorder_dir, uid=uid.hex()[:12],
            owns_store=origin.owned_store is not None, lost=lost, on_lost=self._peer_lost,
            current=self._current, closed=self._is_closed)
        self._p2p = PointToPoint(rank, self.timeout, check=health.check,
                                 on_timeout=health.timeout_error, seq=self._last_seq)
        try:
            self._fabric = fabric = Fabric(g, origin, uid, self._p2p.engine,
                                           health.explain_loss, lost, deadline)
        except BaseException:
            self._health.detach()
            raise
        self._p2p.bind(fabric)
        health.attach(fabric)
        self._waiter = Waiter(fabric.bell, fabric.spin_s, health.check,
                              yield_cpu=fabric.oversubscribed)
        fabric.attach_host(self._waiter)
        self._seq = Sequencer(rank, self.timeout, self._rec, health, fabric.mark_done)
        self._plans = Plans(rank, size, g.ring)
        self._fast = FastPath.make(self._seq, fabric.host, self._calls, size,
                                    lambda n: self._choose("allreduce", n, n).name)
        self._situation = replace(
            selector.situation(size, g.all_local and size > 1, bool(g.remote),
                               self._cfg.shm_slot_size, g.topology, self._cfg.transport != "tcp"),
            composite=origin.composite)
        self._choose = selector.Chooser(self._situation, self._cfg.algo)
        if self._cfg.debug == "check":
            from . import check

            check.install(self)
        _live.add(self)
        log.debug("rank %d: communicator %s of %d ranks, %d local", rank, origin.meet.prefix,
                  size, len(g.local_ranks))

    # -- what the parts ask of the facade -------------------------------------------------

    def _current(self) -> OpCtx | None:
        seq = getattr(self, "_seq", None)
        return seq.current() if seq is not None else None

    def _last_seq(self) -> int:
        return self._seq.seq

    def _is_closed(self) -> bool:
        return self._closed

    def _peer_lost(self, peer: int, exc: BaseException) -> None:
        self._p2p.peer_failed(peer, exc)

    # -- public helpers -------------------------------------------------------------------

    @property
    def topology(self) -> Any:
        """The job's topology as this communicator sees it (topology.model.Topology)."""
        return self._group.topology

    @property
    def all_local(self) -> bool:
        """Whether every rank shares this rank's memory."""
        return self._group.all_local

    @property
    def situation(self) -> selector.Situation:
        """What algorithm selection sees here (identical on every rank)."""
        return self._situation

    def peer_transport(self, rank: int) -> str:
        """Which transport this rank uses to reach ``rank``: "shm" or "tcp"."""
        rank = check_rank(rank, self.size, self.rank, "peer_transport", "rank")
        return "shm" if self._group.is_local(rank) else "tcp"

    def describe(self) -> dict[str, Any]:
        """Facts for diagnostics and tests: local ranks, transports, TCP addresses, peers
        read in place, hierarchical sub-communicators (once made)."""
        info: dict[str, Any] = {
            "rank": self.rank, "size": self.size, "local_ranks": list(self._group.local_ranks),
            # the ids every TCP handshake carries in clear (not the secret)
            "identity": {"job": self._origin.job.hex(), "communicator": self._uid.hex()}}
        if self._fabric is not None:
            info.update(self._fabric.describe())
        info["hier"] = None if self._hier is None else self._hier.describe()
        return info

    def __repr__(self) -> str:
        return (f"<plait.Communicator rank {self.rank} of {self.size}, "
                f"{len(self._group.local_ranks)} local{', closed' if self._closed else ''}>")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- dispatch -------------------------------------------------------------------------

    def _launch(self, call: Call, async_op: bool) -> Work | None:
        op = call.op
        alg = self._choose(op, call.nbytes, call.slot_bytes)
        kind = alg.kind
        if kind == registry.HOST:
            name = alg.name

            def fn(ctx: OpCtx) -> None:
                # read at run time, not captured: a failed operation's frames outlive it
                # (tracebacks), and must not keep views into the segment alive
                fabric = self._fabric
                host = fabric.host if fabric is not None else None
                if host is None:
                    raise ClosedError(f"{ctx.where}: the communicator was closed")
                req = host.start(name, call, ctx)
                if not req.done:
                    wait_reqs(ctx, [req], self._waiter)
        elif kind == registry.COMPOSITE:
            def fn(ctx: OpCtx) -> None:
                self._hierarchy().run(call)
        else:
            def fn(ctx: OpCtx) -> None:
                self._run_schedule(alg, call, ctx)
        post = call.post
        if post is not None:
            inner = fn

            def fn(ctx: OpCtx) -> None:
                inner(ctx)
                post()
        return self._seq.submit(op, fn, async_op, call.nbytes, call.dtype, alg.name)

    def _run_schedule(self, alg: registry.Algorithm, call: Call, ctx: OpCtx) -> None:
        fabric = self._fabric
        if fabric is None:
            raise ClosedError(f"{ctx.where}: the communicator was closed")
        sched = self._plans.plan(alg, call)
        run(ctx, sched, call.send, call.recv, call.reducer, storage(call), fabric.channel,
            self._waiter)

    def _hierarchy(self) -> Hier:
        """The sub-communicators of hierarchical operations (algorithms/hier.py), made at
        the first one: every rank runs the same operations in the same order."""
        if self._hier is None:
            self._hier = Hier(self._group.topology, self.rank, self._hier_group)
        return self._hier

    def _hier_group(self, tag: str, ranks: Sequence[int]) -> Communicator:
        # part of the parent's operations: any failure of the parent breaks it, and it
        # must not pick hier itself
        return self._derive(ranks, f"hier/{tag}", ALL, composite=False)

    # -- collectives (arguments normalised by plait.calls) --------------------------------

    def allreduce(self, buf: Any, op: Any = "sum", *, async_op: bool = False) -> Work | None:
        """Reduce ``buf`` over all ranks, in place: every rank gets the result."""
        if not async_op and self._fast is not None and self._fast.allreduce(buf, op):
            return None
        return self._launch(self._calls.allreduce(buf, op), async_op)

    def reduce(self, buf: Any, root: int, op: Any = "sum", *, async_op: bool = False
               ) -> Work | None:
        """Reduce ``buf`` over all ranks into ``buf`` on ``root``; others' buf is unchanged."""
        return self._launch(self._calls.reduce(buf, root, op), async_op)

    def broadcast(self, buf: Any, root: int, *, async_op: bool = False) -> Work | None:
        """Copy ``buf`` of ``root`` into ``buf`` of every rank."""
        return self._launch(self._calls.broadcast(buf, root), async_op)

    def allgather(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = False) -> Work | None:
        """Every rank's ``sendbuf``, rank-major, into every rank's ``recvbuf``."""
        return self._launch(self._calls.allgather(sendbuf, recvbuf), async_op)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                   async_op: bool = False) -> Work | None:
        """Like allgather, with ``counts[i]`` elements from rank i."""
        return self._launch(self._calls.allgatherv(sendbuf, recvbuf, counts), async_op)

    def gather(self, sendbuf: Any, recvbuf: Any, root: int, *, async_op: bool = False
               ) -> Work | None:
        """Every rank's ``sendbuf``, rank-major, into ``recvbuf`` on ``root``."""
        return self._launch(self._calls.gather(sendbuf, recvbuf, root), async_op)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, *, async_op: bool = False
                ) -> Work | None:
        """Block i of ``sendbuf`` on ``root`` into ``recvbuf`` of rank i."""
        return self._launch(self._calls.scatter(sendbuf, recvbuf, root), async_op)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                       async_op: bool = False) -> Work | None:
        """Block i of the reduction of every rank's ``sendbuf`` into ``recvbuf`` of rank i."""
        return self._launch(self._calls.reduce_scatter(sendbuf, recvbuf, op), async_op)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: Any = "sum", *, async_op: bool = False) -> Work | None:
        """Like reduce_scatter with ``counts[i]`` elements for rank i: block i of the
        reduction (blocks packed in rank order) into ``recvbuf`` of rank i."""
        return self._launch(self._calls.reduce_scatterv(sendbuf, recvbuf, counts, op),
                            async_op)

    def alltoall(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = False) -> Work | None:
        """Block j of ``sendbuf`` of rank i into block i of ``recvbuf`` of rank j."""
        return self._launch(self._calls.alltoall(sendbuf, recvbuf), async_op)

    def alltoallv(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any,
                  recv_counts: Sequence[int], *, async_op: bool = False) -> Work | None:
        """Like alltoall with ``send_counts[j]`` elements to rank j and ``recv_counts[i]``
        from rank i (blocks packed in rank order)."""
        return self._launch(self._calls.alltoallv(sendbuf, send_counts, recvbuf, recv_counts),
                            async_op)

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Return once every rank has entered the barrier."""
        return self._launch(self._calls.barrier(), async_op)

    # -- point to point -------------------------------------------------------------------

    def send(self, buf: Any, dst: int, tag: int = 0, *, async_op: bool = False) -> Work | None:
        """Send ``buf`` to ``dst``; returns when ``buf`` may be reused."""
        op = "isend" if async_op else "send"
        self._seq.check_usable(op)
        dst = check_rank(dst, self.size, self.rank, op, "dst")
        tag = check_tag(tag, self.rank, op)
        b = self._calls.buf(buf, op, "buf")
        return self._p2p.send(b.bytes(), dst, tag, op, async_op)

    def recv(self, buf: Any, src: int | None = None, tag: int = 0, *, async_op: bool = False
             ) -> Any:
        """Receive into ``buf`` from ``src`` (any rank if None); returns the source rank
        (or a Work whose ``source`` is set when async)."""
        op = "irecv" if async_op else "recv"
        self._seq.check_usable(op)
        if src is not None:
            src = check_rank(src, self.size, self.rank, op, "src")
        tag = check_tag(tag, self.rank, op)
        b = self._calls.buf(buf, op, "buf", writable=True)
        work = self._p2p.recv(b.bytes(), src, tag, op)
        if async_op:
            return work
        work.wait()
        return work.source

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        w = self.send(buf, dst, tag, async_op=True)
        return w if w is not None else done_work()

    def irecv(self, buf: Any, src: int | None = None, tag: int = 0) -> Work:
        w = self.recv(buf, src, tag, async_op=True)
        if not isinstance(w, Work):
            raise TypeError("irecv: expected a Work")
        return w

    # -- derived communicators -------------------------------------------------------------

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Collective over this communicator: ranks with equal ``color`` form a new
        communicator, ordered by (key, rank here); ``color=None`` gets None."""
        check_split(color, key, self.rank)
        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        everyone = np.empty(2 * self.size, dtype=np.int64)
        self.allgather(mine, everyone)
        self._split_seq += 1
        if color is None:
            return None
        pairs = everyone.reshape(self.size, 2)
        members = sorted((int(pairs[r, 1]), r) for r in range(self.size)
                         if pairs[r, 0] == color)
        return self._derive([r for _, r in members], f"split{self._split_seq}/c{color}",
                            MEMBERS)

    def shrink(self, exclude: Sequence[int] | None = None, *,
               timeout: float | datetime.timedelta | None = None) -> ShrinkResult[Communicator]:
        """Every survivor calls it, also on a communicator broken by a failure: the ranks
        alive, joined within ``timeout`` (default: the communicator's) and in no
        survivor's ``exclude``, agreed on through the store and renumbered in order, with
        the last collective completed on all of them (plait.shrink, ShrinkResult)."""
        self._shrink_gen += 1
        return shrink_communicator(
            self._health, self._seq.completed, self._shrink_gen, exclude,
            to_seconds(timeout, self.timeout),
            lambda ranks, tag: self._derive(ranks, tag, MEMBERS, adopt=False))

    def _derive(self, ranks: Sequence[int], tag: str, mode: str, *, composite: bool = True,
                cfg: Config | None = None, adopt: bool = True) -> Communicator:
        """The one way to make a communicator from this one: the ranks ``ranks`` (this
        communicator's numbering, in the child's order) meet under key ``tag`` in the
        store (no collective on this communicator, which may be busy or broken); ``mode``
        says which of this communicator's failures break the child (membership.Scope);
        ``adopt``: ``abort()`` of this one aborts the child (not a shrunk successor)."""
        origin = self._origin.child(tag, mode=mode,
                                    host_local_rank=self._group.host_local_rank,
                                    composite=composite, cfg=cfg)
        child = Communicator(origin, list(ranks).index(self.rank), len(ranks))
        if adopt:
            self._children.add(child)
        return child

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Free this rank's resources (local). Later calls raise ClosedError. Closing
        while collectives are queued or running aborts them (see ``abort``)."""
        self._stop(aborted=False)

    def abort(self) -> None:
        """Stop at once: this rank's pending operations fail with ClosedError, every other
        rank waiting in an operation of this communicator fails with PeerFailedError
        naming this rank (within about 0.5 s), and resources are released as by close().
        Communicators derived from this one are aborted too."""
        for child in list(self._children):
            child.abort()
        self._stop(aborted=True)

    def flight_record(self) -> list[dict[str, Any]]:
        """The flight recorder's view of the last collectives, oldest first: seq, op,
        bytes, dtype, algorithm, state (queued/running/done/failed), wall-clock issued/
        started/ended times, duration_us, error (see plait.flightrec)."""
        return self._rec.records()

    def _stop(self, aborted: bool) -> None:
        seq = getattr(self, "_seq", None)
        shut = seq.shut() if seq is not None else ([], False)
        if shut is None or self._closed:
            return
        self._closed = True
        pending, running = shut
        what = "aborted" if aborted else "closed"
        if aborted or pending or running:
            self._health.publish(self.rank, f"rank {self.rank} {what} its communicator with "
                                 f"{len(pending) + running} collective(s) pending", "aborted")
        exc = ClosedError(f"rank {self.rank}: the communicator was {what}")
        for work in pending:
            work.fail(exc)
        if self._fabric is not None:
            self._fabric.bell.ring()  # a waiting operation sees the close at once
        if seq is not None:
            seq.drain()
        self._p2p.close(exc)
        self._teardown()

    def _teardown(self) -> None:
        if self._seq.broken is not None or self._health.failure is not None:
            # the failed operation's frames may hold views into the segments of this
            # communicator and of its sub-communicators: release them before unmapping
            self._drop_views()
        if self._hier is not None:
            hier, self._hier = self._hier, None
            hier.close()
        fabric, self._fabric = self._fabric, None
        # the old waiter's doorbell is a view into the segment, which must be unmapped
        self._waiter = Waiter(private_bell(), 0.0, self._health.check)
        if fabric is not None:
            fabric.close(self._drop_views)
        self._health.detach()
        self._origin = replace(self._origin, owned_store=None)

    def _drop_views(self) -> None:
        # A failed operation's traceback (kept by the sequencer, or by the caller who
        # caught it) holds the frames' views into the segment: drop their locals.
        _clear_frames([self._seq.broken, self._health.failure, *self._health.lost.values()])

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


def _clear_frames(errors: list[BaseException | None]) -> None:
    """Drop the locals of the frames in these errors' tracebacks (and their causes'),
    then collect: what those frames held may be views into shared memory."""
    todo = list(errors)
    seen: set[int] = set()
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        todo += [exc.__cause__, exc.__context__]  # the frames an adopted error hides
    gc.collect()
