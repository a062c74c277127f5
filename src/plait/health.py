"""Failure detection, propagation and diagnosis for one communicator.

A rank learns of a failure directly in three ways: a TCP connection from the peer breaks
(``TcpHub`` -> ``on_peer_lost``), a send to it fails, or -- for ranks sharing its
shared-memory segment -- its process is gone while its ``W_CLOSED`` flag is unset
(checked every 0.5 s while waiting). A rank that has no connection to the lost one (a
ring neighbour's neighbour, a rank on another host) would otherwise wait until its
timeout, so the rank that detects a failure publishes an **abort notice**:

- in its own shared-memory control block (word ``W_ABORT``: ``1 + lost rank``, or
  ``ABORTED`` when the rank aborted its own communicator) and rings every local rank's
  doorbells, so local waiters see it within one sleep (at most 50 ms);
- in the store, key ``<communicator prefix>/abort`` (JSON: who reports, who was lost,
  why), which every waiting rank polls at most every 0.5 s.

Every wait calls :meth:`Health.check` between sleeps (``Waiter.check``). A rank that
finds a notice raises :class:`PeerFailedError` naming the lost rank and the reporter. If
the store itself has gone (rank 0 hosts the TCPStore when plait makes it from
MASTER_ADDR/MASTER_PORT), the store error is the failure.

Diagnosis: a rank blocked for ``min(1 s, timeout / 4)`` in an operation publishes
``<prefix>/status/<rank>`` (op, sequence number) in the store and ``W_OP_SEQ`` in its
control block; every rank also writes the sequence number of each collective it finishes
(``W_OP_DONE``, one store on the hot path). A rank that times out reads both and says
where every rank is ("rank 2 is idle after allreduce #41; ranks 0, 1, 3 are in allreduce
#42"), logs its flight record at WARNING and writes it to ``PLAIT_FLIGHT_RECORDER_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from . import flightrec
from .errors import ClosedError, CommTimeoutError, PeerFailedError, PlaitError
from .transport import shm

if TYPE_CHECKING:
    from .comm import Communicator
    from .executor import OpCtx

log = logging.getLogger("plait")

POLL_S = 0.5
"""How often a waiting rank checks local pids and the store's abort key."""
ABORTED = -1
"""``W_ABORT`` value of a rank that aborted its own communicator."""
UNKNOWN_LOST = -2
"""``W_ABORT`` value of a failure whose lost rank is unknown (see the store's notice)."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class Health:
    """The failure state of one communicator (one per Communicator, made before set-up)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.next_poll = 0.0
        self.failure: PeerFailedError | None = None  # a notice this rank has seen
        self.published = False
        self.status_seq = 0  # the op whose "waiting" status is in the store
        self.status_after = min(1.0, comm.timeout / 4)
        self.dumped = False

    @property
    def key(self) -> str:
        return f"{self.comm._prefix}/abort"

    def _keys(self) -> list[tuple[str, bool]]:
        """(abort key, is a parent's) to poll: this communicator's, and those of the
        communicators whose hierarchical algorithms this one is part of (prefix
        ``<parent>/hier/...``): they die with their parent."""
        keys = [(self.key, False)]
        prefix = self.comm._prefix
        while "/hier/" in prefix:
            prefix = prefix.rsplit("/hier/", 1)[0]
            keys.append((f"{prefix}/abort", True))
        return keys

    def _my_rank(self, lost_id: Any) -> int | None:
        ids = self.comm._peer_ids
        if lost_id is None:
            return None
        t = (lost_id[0], lost_id[1])
        return ids.index(t) if t in ids else None

    def adopt(self, exc: BaseException, ctx: OpCtx) -> BaseException:
        """``exc`` escaped an operation of this communicator: stamp a peer failure with the
        lost process's identity, and if it names a sub-communicator's rank, return an error
        naming this communicator's rank."""
        if not isinstance(exc, PeerFailedError):
            return exc
        ids = self.comm._peer_ids
        lost_id = getattr(exc, "lost_id", None)
        if lost_id is None:  # raised by this communicator's own transports
            if exc.peer is not None and 0 <= exc.peer < len(ids):
                exc.lost_id = ids[exc.peer]  # type: ignore[attr-defined]
            text = str(exc)
            if text.startswith(ctx.where) or exc is self.failure:
                return exc
            # transport errors say "rank 2: connection from rank 1 was lost": add the op
            text = text.removeprefix(f"rank {self.rank}: ")
            err = PeerFailedError(f"{ctx.where}: {text}", exc.peer)
            err.lost_id = getattr(exc, "lost_id", None)  # type: ignore[attr-defined]
            return err
        mine = self._my_rank(lost_id)
        if mine is None or mine == exc.peer:
            return exc
        err = PeerFailedError(f"{ctx.where}: rank {mine} failed: {exc}", mine)
        err.lost_id = lost_id  # type: ignore[attr-defined]
        return err

    def _status_key(self, rank: int) -> str:
        return f"{self.comm._prefix}/status/{rank}"

    def _where(self) -> str:
        ctx = self.comm._cur_ctx
        return ctx.where if ctx is not None else f"rank {self.rank}"

    # -- checking (every wait, between sleeps) ---------------------------------------------

    def check(self) -> None:
        c = self.comm
        if c._closed:
            raise ClosedError(f"rank {self.rank}: the communicator was closed")
        if self.failure is not None:
            raise self.failure
        seg = c._seg
        if seg is not None:
            col = seg.ctl[:, shm.W_ABORT]
            if col.any():
                self._shm_notice(col)
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + POLL_S
        if seg is not None:
            self._check_local_pids(seg)
        self._poll_store()
        ctx = c._cur_ctx
        if ctx is not None and self.status_seq != ctx.seq \
                and now - (ctx.deadline - c.timeout) >= self.status_after:
            # blocked for a while: say so, in the segment (W_OP_SEQ, read by local peers'
            # timeout reports; written here rather than on the hot path) and in the store
            mine = c._my_ctl
            if mine is not None:
                mine[shm.W_OP_SEQ] = ctx.seq
            self._publish_status(ctx.name, ctx.seq, "waiting")

    def _check_local_pids(self, seg: shm.Segment) -> None:
        c = self.comm
        ctl = seg.ctl
        for i, r in enumerate(c._local_ranks):
            if r == self.rank or ctl[i, shm.W_CLOSED]:
                continue
            pid = int(ctl[i, shm.W_PID])
            if pid and not pid_alive(pid):
                exc = PeerFailedError(f"{self._where()}: rank {r} (pid {pid}) died without "
                                      "closing its communicator", r)
                c._lost.setdefault(r, exc)
                raise exc

    def _shm_notice(self, col: Any) -> None:
        c = self.comm
        for i, v in enumerate(col.tolist()):
            if not v or i == c._me_local:
                continue
            by = c._local_ranks[i]
            if v == ABORTED:
                self._raise_notice(by, by, "aborted its communicator")
            lost = v - 1 if v > 0 else None
            self._raise_notice(lost, by, "reported the failure (see the store's notice)"
                               if lost is None else "")

    def _poll_store(self) -> None:
        c = self.comm
        store = c._store
        if store is None:
            return
        raw, parents = None, False
        try:
            for key, of_parent in self._keys():
                if store.check([key]):
                    raw, parents = store.get(key), of_parent
                    break
        except Exception as exc:  # the store's host is gone: that is the failure
            host = 0 if c._owned_store is not None or c._store_host == 0 else None
            who = ("rank 0, which hosts it, has probably died" if host == 0 else
                   "the process hosting it (rank 0 under most launchers) has probably died")
            err = PeerFailedError(f"{self._where()}: the rendezvous store is unreachable "
                                  f"({type(exc).__name__}: {exc}); {who}", host)
            self.failure = err
            raise err from exc
        if raw is None:
            return
        try:
            notice = json.loads(bytes(raw).decode())
        except (ValueError, UnicodeDecodeError):
            notice = {"by": None, "lost": None, "why": repr(bytes(raw)[:200])}
        by, lost, lost_id = notice.get("by"), notice.get("lost"), notice.get("lost_id")
        if parents:  # numbered in the parent: translate, and say so
            lost = self._my_rank(lost_id)
            if notice.get("what") == "aborted":
                self._raise_notice(None, None, f"rank {by} of the parent communicator "
                                   "aborted it", lost_id)
            self._raise_notice(lost, None, f"the parent communicator failed: "
                               f"{notice.get('why', '')}", lost_id)
        if notice.get("what") == "aborted":
            self._raise_notice(by, by, "aborted its communicator", lost_id)
        self._raise_notice(lost, by, str(notice.get("why", "")), lost_id)

    def _raise_notice(self, lost: int | None, by: int | None, why: str,
                      lost_id: Any = None) -> None:
        c = self.comm
        if by is None:
            text = why
        elif lost == by:
            text = f"rank {by} {why}"
        else:
            who = f"rank {lost}" if lost is not None else "a rank"
            text = f"{who} failed (reported by rank {by}{': ' + why if why else ''})"
        exc = PeerFailedError(f"{self._where()}: {text}", lost)
        if lost_id is not None:
            exc.lost_id = tuple(lost_id)  # type: ignore[attr-defined]
        self.failure = exc
        if lost is not None:
            c._lost.setdefault(lost, exc)
            c._p2p.peer_failed(lost, exc)
        raise exc

    def explain_loss(self, peer: int, exc: PeerFailedError) -> PeerFailedError:
        """``peer``'s connection was lost: if there is an abort notice, it says why (a rank
        that gave up because another one failed closes its connections right after
        publishing it); return the error to report. Called by the TCP reader thread."""
        if self.failure is not None:
            return self.failure
        try:
            self._poll_store()
        except PeerFailedError as notice:
            if notice.peer is not None:  # the notice says why (also when it names peer)
                return notice
            self.failure = None
        return exc

    # -- publishing ------------------------------------------------------------------------

    def on_failure(self, exc: BaseException) -> None:
        """An operation of this rank failed with ``exc`` (the communicator is now broken):
        tell every other rank if a peer was lost, and write the flight record."""
        if isinstance(exc, PeerFailedError) and exc is not self.failure and not self.published:
            self.publish(exc.peer, str(exc), "failed", getattr(exc, "lost_id", None))
        self._dump(f"{type(exc).__name__}: {exc}")

    def publish(self, lost: int | None, why: str, what: str, lost_id: Any = None) -> None:
        """Publish an abort notice (shared memory and store); never raises."""
        if self.published:
            return
        self.published = True
        c = self.comm
        seg = c._seg
        if seg is not None:
            try:
                if what == "aborted":
                    v = ABORTED
                else:
                    v = lost + 1 if lost is not None else UNKNOWN_LOST
                seg.ctl[seg.me, shm.W_ABORT] = v
                for b in list(seg.bells) + list(seg.p2p_bells):
                    b.ring()
            except (TypeError, ValueError, IndexError):  # segment being torn down
                pass
        store = c._store
        if store is not None:
            ids = c._peer_ids
            if lost_id is None and lost is not None and 0 <= lost < len(ids):
                lost_id = ids[lost]
            notice = json.dumps({"by": self.rank, "lost": lost, "what": what,
                                 "lost_id": list(lost_id) if lost_id is not None else None,
                                 "why": why[:2000]})
            try:
                if not store.check([self.key]):
                    store.set(self.key, notice)
            except Exception as exc:
                log.debug("rank %d: could not publish the abort notice: %s", self.rank, exc)

    def _publish_status(self, op: str, seq: int, state: str) -> None:
        store = self.comm._store
        self.status_seq = seq
        if store is None:
            return
        try:
            store.set(self._status_key(self.rank), json.dumps(
                {"op": op, "seq": seq, "state": state, "time": time.time()}))
        except Exception as exc:
            log.debug("rank %d: could not publish its status: %s", self.rank, exc)

    def done(self, op: str, seq: int) -> None:
        """The operation whose "waiting" status was published has completed."""
        self._publish_status(op, seq, "done")

    # -- diagnosis -------------------------------------------------------------------------

    def timeout_error(self, ctx: OpCtx, message: str) -> CommTimeoutError:
        self._publish_status(ctx.name, ctx.seq, "waiting")
        try:
            where = self.where_are_ranks(ctx)
        except Exception as exc:  # diagnosis must never hide the timeout itself
            where = f"(could not collect the other ranks' state: {exc})"
        text = f"{message}; {where}"
        self._dump(text)
        return CommTimeoutError(text)

    def where_are_ranks(self, ctx: OpCtx) -> str:
        """One phrase per group of ranks in the same state."""
        c = self.comm
        rec = c._rec
        states: dict[int, str] = {self.rank: f"is in {ctx.name} #{ctx.seq}"}
        seg = c._seg
        if seg is not None:
            ctl = seg.ctl
            for i, r in enumerate(c._local_ranks):
                if r == self.rank:
                    continue
                started, done = int(ctl[i, shm.W_OP_SEQ]), int(ctl[i, shm.W_OP_DONE])
                if ctl[i, shm.W_CLOSED]:
                    states[r] = "closed its communicator"
                elif started > done:
                    states[r] = f"is in {rec.op_name(started)} #{started}"
                elif done:
                    states[r] = f"is idle after {rec.op_name(done)} #{done}"
                else:
                    states[r] = "has not started a collective"
        store = c._store
        for r in range(c.size):
            if r in states:
                continue
            report = None
            if store is not None:
                try:
                    key = self._status_key(r)
                    if store.check([key]):
                        report = json.loads(bytes(store.get(key)).decode())
                except Exception:
                    report = None
            if report is None:
                states[r] = ("has not reported (not blocked in plait for "
                             f"{self.status_after:g} s: busy outside plait, or stuck before "
                             "calling the collective)")
            elif report.get("state") == "done":
                states[r] = f"is past {report.get('op')} #{report.get('seq')}"
            else:
                states[r] = f"is in {report.get('op')} #{report.get('seq')}"
        groups: dict[str, list[int]] = {}
        for r in sorted(states):
            groups.setdefault(states[r], []).append(r)
        parts = []
        # this rank's group goes last: "rank 2 is idle after ...; ranks 0, 1, 3 are in ..."
        mine = states[self.rank]
        for state, rs in sorted(groups.items(), key=lambda kv: (kv[0] == mine, kv[1])):
            if len(rs) > 1:
                for one, many in (("is ", "are "), ("has ", "have ")):
                    if state.startswith(one):
                        state = many + state[len(one):]
            parts.append(f"{_ranks(rs)} {state}")
        return "; ".join(parts)

    def _dump(self, reason: str) -> None:
        if self.dumped:
            return
        self.dumped = True
        c = self.comm
        try:
            records = c._rec.records()
            if isinstance(reason, str) and "timed out" in reason:
                log.warning("rank %d: %s\nflight record (newest last):\n%s", self.rank, reason,
                            flightrec.format_records(records))
            path = flightrec.dump(c._cfg.flight_recorder_dir, self.rank, c._uid.hex()[:12],
                                  records, reason)
            if path:
                log.warning("rank %d: flight record written to %s", self.rank, path)
        except Exception as exc:  # never hide the failure being reported
            log.debug("rank %d: flight record dump failed: %s", self.rank, exc)


__all__ = ["ABORTED", "POLL_S", "Health", "PlaitError", "pid_alive"]
