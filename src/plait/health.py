"""Failure detection, propagation and diagnosis for one communicator.

A rank learns of a failure directly in three ways: a TCP connection from the peer breaks
(the transport calls ``explain_loss``), a send to it fails, or -- for ranks sharing its
shared-memory segment -- its process is gone while its ``W_CLOSED`` flag is unset
(a pidfd watch, checked every 0.5 s while waiting: transport/liveness.py). A rank that
has no connection to the lost one (a ring neighbour's neighbour, a rank on another host)
would otherwise wait until its timeout, so the rank that detects a failure publishes an
**abort notice**:

- in its own shared-memory control block (word ``W_ABORT``: ``1 + lost rank``, or
  ``ABORTED`` when the rank aborted its own communicator) and rings every local rank's
  doorbells, so local waiters see it within one sleep (at most 50 ms);
- in the store, key ``<communicator prefix>/abort`` (JSON: who reports, who was lost,
  why), which every waiting rank polls at most every 0.5 s.

Every wait calls :meth:`Health.check` between sleeps (``Waiter.check``). A derived
communicator also watches its ancestors' notices (``membership.Scope``): hier's
sub-communicators fail with any failure of their parent, independent children (split)
only when the lost rank is one of their own members. A rank that
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
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import flightrec
from .errors import ClosedError, CommTimeoutError, PeerFailedError, PlaitError
from .flightrec import FlightRecorder
from .membership import ALL, Group, Scope
from .rendezvous import Meeting
from .transport import liveness
from .transport.base import OpCtx, PeerState, QuietPeers

log = logging.getLogger("plait")

POLL_S = 0.5
"""How often a waiting rank checks local processes and the store's abort key."""
ABORTED = -1
"""``W_ABORT`` value of a rank that aborted its own communicator."""
UNKNOWN_LOST = -2
"""``W_ABORT`` value of a failure whose lost rank is unknown (see the store's notice)."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie is not: transport/liveness.py)."""
    watch = liveness.ProcessWatch.open(pid)
    try:
        return watch.alive()
    finally:
        watch.close()


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class Signals(Protocol):
    """What health needs of the transports (plait.fabric.Fabric)."""

    def dead_peers(self) -> list[tuple[int, str]]: ...

    def notices(self) -> list[tuple[int, int]]: ...

    def publish_notice(self, value: int) -> None: ...

    def peer_states(self) -> dict[int, PeerState]: ...

    def mark(self, *, blocked: int | None = None, done: int | None = None) -> None: ...


class Health:
    """The failure state of one communicator (made before its transports, which report
    losses to it; ``attach`` gives it their signals)."""

    def __init__(self, *, group: Group, meet: Meeting, scope: Scope, recorder: FlightRecorder,
                 timeout: float, flight_dir: str, uid: str, owns_store: bool,
                 lost: dict[int, BaseException],
                 on_lost: Callable[[int, BaseException], None],
                 current: Callable[[], OpCtx | None], closed: Callable[[], bool]) -> None:
        self.group = group
        self.rank = group.rank
        self.meet: Meeting | None = meet
        self.scope = scope
        self.rec = recorder
        self.timeout = timeout
        self.flight_dir = flight_dir
        self.uid = uid
        self.owns_store = owns_store
        self.lost = lost
        self.on_lost = on_lost
        self.current = current
        self.closed = closed
        self.signals: Signals = QuietPeers()
        self.next_poll = 0.0
        self.failure: PeerFailedError | None = None  # a notice this rank has seen
        self.published = False
        self.status_seq = 0  # the op whose "waiting" status is in the store
        self.status_after = min(1.0, timeout / 4)
        self.dumped = False

    def attach(self, signals: Signals) -> None:
        self.signals = signals

    def detach(self) -> None:
        """The communicator is being torn down: no store, no transports any more."""
        self.signals = QuietPeers()
        self.meet = None

    @property
    def key(self) -> str:
        return f"{self.meet.prefix if self.meet else ''}/abort"

    def _keys(self) -> list[tuple[str, str | None]]:
        """(abort key, None for this communicator's own or the scope mode of an
        ancestor's) to poll."""
        return [(self.key, None), *self.scope.parents]

    def adopt(self, exc: BaseException, ctx: OpCtx) -> BaseException:
        """``exc`` escaped an operation of this communicator: stamp a peer failure with the
        lost process's identity, and if it names a sub-communicator's rank, return an error
        naming this communicator's rank."""
        if not isinstance(exc, PeerFailedError):
            return exc
        g = self.group
        if exc.lost_id is None:  # raised by this communicator's own transports
            if exc.peer is not None and 0 <= exc.peer < g.size:
                exc.lost_id = g.process(exc.peer)
            text = str(exc)
            if text.startswith(ctx.where) or exc is self.failure:
                return exc
            # transport errors say "rank 2: connection from rank 1 was lost": add the op
            text = text.removeprefix(f"rank {self.rank}: ")
            return PeerFailedError(f"{ctx.where}: {text}", exc.peer, exc.lost_id)
        mine = g.rank_of(exc.lost_id)
        if mine is None or mine == exc.peer:
            return exc
        return PeerFailedError(f"{ctx.where}: rank {mine} failed: {exc}", mine, exc.lost_id)

    def _where(self) -> str:
        ctx = self.current()
        return ctx.where if ctx is not None else f"rank {self.rank}"

    # -- checking (every wait, between sleeps) ---------------------------------------------

    def check(self) -> None:
        if self.closed():
            raise ClosedError(f"rank {self.rank}: the communicator was closed")
        if self.failure is not None:
            raise self.failure
        notices = self.signals.notices()
        if notices:
            self._shm_notice(notices)
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + POLL_S
        self._check_local_pids()
        self._poll_store()
        ctx = self.current()
        if ctx is not None and self.status_seq != ctx.seq \
                and now - (ctx.deadline - self.timeout) >= self.status_after:
            # blocked for a while: say so, in the segment (W_OP_SEQ, read by local peers'
            # timeout reports; written here rather than on the hot path) and in the store
            self.signals.mark(blocked=ctx.seq)
            self._publish_status(ctx.name, ctx.seq, "waiting")

    def _check_local_pids(self) -> None:
        for r, who in self.signals.dead_peers():
            exc = PeerFailedError(f"{self._where()}: rank {r} ({who}) died without "
                                  "closing its communicator", r)
            self.lost.setdefault(r, exc)
            self.on_lost(r, exc)  # receives posted from it fail too, not only this wait
            raise exc

    def _shm_notice(self, notices: list[tuple[int, int]]) -> None:
        for by, v in notices:
            if v == ABORTED:
                self._raise_notice(by, by, "aborted its communicator")
            lost = v - 1 if v > 0 else None
            self._raise_notice(lost, by, "reported the failure (see the store's notice)"
                               if lost is None else "")

    def _poll_store(self) -> None:
        meet = self.meet
        if meet is None:
            return
        store = meet.store
        raw, mode = None, None
        try:
            for key, of_parent in self._keys():
                if store.check([key]):
                    raw, mode = store.get(key), of_parent
                    if mode is None or mode == ALL or self._concerns_me(raw):
                        break
                    raw = None  # an independent child: not one of our members
        except Exception as exc:  # the store's host is gone: that is the failure
            host = 0 if self.owns_store else None
            who = ("rank 0, which hosts it, has probably died" if host == 0 else
                   "the process hosting it (rank 0 under most launchers) has probably died")
            err = PeerFailedError(f"{self._where()}: the rendezvous store is unreachable "
                                  f"({type(exc).__name__}: {exc}); {who}", host)
            self.failure = err
            raise err from exc
        if raw is None:
            return
        notice = _parse_notice(raw)
        by, lost, lost_id = notice.get("by"), notice.get("lost"), notice.get("lost_id")
        if mode == ALL:  # numbered in the parent: translate, and say so
            lost = self.group.rank_of(lost_id)
            if notice.get("what") == "aborted":
                self._raise_notice(None, None, f"rank {by} of the parent communicator "
                                   "aborted it", lost_id)
            self._raise_notice(lost, None, f"the parent communicator failed: "
                               f"{notice.get('why', '')}", lost_id)
        if mode is not None:  # an independent child: one of its members was lost
            lost = self.group.rank_of(lost_id)
            self._raise_notice(lost, None, f"rank {lost} failed (reported on a parent "
                               f"communicator: {notice.get('why', '')})", lost_id)
        if notice.get("what") == "aborted":
            self._raise_notice(by, by, "aborted its communicator", lost_id)
        self._raise_notice(lost, by, str(notice.get("why", "")), lost_id)

    def _concerns_me(self, raw: Any) -> bool:
        notice = _parse_notice(raw)
        return notice.get("what") != "aborted" and \
            self.group.rank_of(notice.get("lost_id")) is not None

    def _raise_notice(self, lost: int | None, by: int | None, why: str,
                      lost_id: Any = None) -> None:
        if by is None:
            text = why
        elif lost == by:
            text = f"rank {by} {why}"
        else:
            who = f"rank {lost}" if lost is not None else "a rank"
            text = f"{who} failed (reported by rank {by}{': ' + why if why else ''})"
        exc = PeerFailedError(f"{self._where()}: {text}", lost,
                              tuple(lost_id) if lost_id is not None else None)
        self.failure = exc
        if lost is not None:
            self.lost.setdefault(lost, exc)
            self.on_lost(lost, exc)
        raise exc

    def explain_loss(self, peer: int, exc: BaseException) -> BaseException:
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

    # -- what shrink asks (plait.shrink) ---------------------------------------------------

    def dead_ranks(self) -> set[int]:
        """Local ranks whose process is gone, or that closed this communicator: direct
        evidence, read from the segment and the pidfd watches (never raises)."""
        out = {r for r, _ in self.signals.dead_peers()}
        out.update(r for r, st in self.signals.peer_states().items() if st.closed)
        return out

    def lost_ranks(self) -> set[int]:
        """Every rank this one knows to be lost, without raising: recorded losses, dead
        local processes, shared-memory notices and the store's notices (this
        communicator's, and its ancestors' translated by process). A store error
        propagates (the caller says what it means)."""
        out = set(self.lost) | self.dead_ranks()
        if self.failure is not None and self.failure.peer is not None:
            out.add(self.failure.peer)
        out.update(v - 1 for _, v in self.signals.notices() if v > 0)
        store = self.meet.store if self.meet is not None else None
        for key, mode in self._keys() if store is not None else ():
            if store.check([key]):
                notice = _parse_notice(store.get(key))
                if notice.get("what") == "aborted":
                    continue  # the aborting rank may well be shrinking too
                lost = notice.get("lost") if mode is None else \
                    self.group.rank_of(notice.get("lost_id"))
                if isinstance(lost, int) and 0 <= lost < self.group.size:
                    out.add(lost)
        out.discard(self.rank)
        return out

    # -- publishing ------------------------------------------------------------------------

    def on_failure(self, exc: BaseException) -> None:
        """An operation of this rank failed with ``exc`` (the communicator is now broken):
        tell every other rank if a peer was lost, and write the flight record."""
        if isinstance(exc, PeerFailedError) and exc is not self.failure and not self.published:
            self.publish(exc.peer, str(exc), "failed", exc.lost_id)
        self._dump(f"{type(exc).__name__}: {exc}")

    def publish(self, lost: int | None, why: str, what: str, lost_id: Any = None) -> None:
        """Publish an abort notice (transports and store); never raises."""
        if self.published:
            return
        self.published = True
        if what == "aborted":
            v = ABORTED
        else:
            v = lost + 1 if lost is not None else UNKNOWN_LOST
        self.signals.publish_notice(v)
        meet = self.meet
        if meet is None:
            return
        if lost_id is None and lost is not None and 0 <= lost < self.group.size:
            lost_id = self.group.process(lost)
        notice = json.dumps({"by": self.rank, "lost": lost, "what": what,
                             "lost_id": list(lost_id) if lost_id is not None else None,
                             "why": why[:2000]})
        try:
            if not meet.check("abort"):
                meet.set("abort", notice)
        except Exception as exc:
            log.debug("rank %d: could not publish the abort notice: %s", self.rank, exc)

    def _publish_status(self, op: str, seq: int, state: str) -> None:
        meet = self.meet
        self.status_seq = seq
        if meet is None:
            return
        try:
            meet.set(f"status/{self.rank}", json.dumps(
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
        rec = self.rec
        states: dict[int, str] = {self.rank: f"is in {ctx.name} #{ctx.seq}"}
        for r, st in self.signals.peer_states().items():
            if st.closed:
                states[r] = "closed its communicator"
            elif st.started > st.done:
                states[r] = f"is in {rec.op_name(st.started)} #{st.started}"
            elif st.done:
                states[r] = f"is idle after {rec.op_name(st.done)} #{st.done}"
            else:
                states[r] = "has not started a collective"
        meet = self.meet
        for r in range(self.group.size):
            if r in states:
                continue
            report = None
            if meet is not None:
                try:
                    if meet.check(f"status/{r}"):
                        report = json.loads(meet.get(f"status/{r}", 1.0).decode())
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
        try:
            records = self.rec.records()
            if isinstance(reason, str) and "Timed out" in reason:
                log.warning("rank %d: %s\nflight record (newest last):\n%s", self.rank, reason,
                            flightrec.format_records(records))
            path = flightrec.dump(self.flight_dir, self.rank, self.uid, records, reason)
            if path:
                log.warning("rank %d: flight record written to %s", self.rank, path)
        except Exception as exc:  # never hide the failure being reported
            log.debug("rank %d: flight record dump failed: %s", self.rank, exc)


def _parse_notice(raw: Any) -> dict[str, Any]:
    try:
        notice = json.loads(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        notice = None
    if not isinstance(notice, dict):
        notice = {"by": None, "lost": None, "why": repr(bytes(raw)[:200])}
    return notice


__all__ = ["ABORTED", "POLL_S", "Health", "PlaitError", "pid_alive"]
