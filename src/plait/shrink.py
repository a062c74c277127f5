"""Shrinking a communicator: the survivors of a failure agree on who is left and derive a
communicator of them (``Communicator.shrink``), without a collective on the old one.

Every survivor calls it. A rank is lost if some survivor knows it to be dead (its
process is gone or it closed the communicator, a broken connection, an abort notice:
``Health.lost_ranks``) or if it has not joined within the timeout; ``exclude`` also drops
ranks that are alive (the union over the survivors' ``exclude`` lists).

Agreement goes through the store, under ``<communicator prefix>/shrink<g>/agree`` (``g``:
this communicator's shrink generation, so a second shrink of the same communicator, or a
shrink of the shrunk one, never reads the first one's keys):

1. each survivor posts ``join/<rank>``: the sequence number of the last collective it
   completed, its ``exclude`` list, the ranks it knows to be lost;
2. the decider -- the lowest rank that is neither known lost nor excluded -- waits until
   every rank that is neither has joined, or until the timeout; then it writes
   ``decision`` (the members: the joined ranks not excluded and not dead; the last
   sequence number completed on every member, the minimum over them) with
   ``compare_set(key, "", value)``, which sets the key only if it is absent and returns
   what it holds. Every survivor adopts that value, so however many ranks end up
   deciding (the decider died, so the next lowest took over; a rank passed its hard
   deadline), all of them adopt the same, first decision;
3. everyone else waits for ``decision``; a rank not in it raises ``ShrinkExcludedError``.

A merely slow rank is therefore never dropped by one survivor and kept by another: there
is one decision. The members then derive the new communicator (ranks renumbered in
order, failure scope ``MEMBERS``: the old communicator's notices break it only for its
own members) through ``Communicator._derive``, under ``<prefix>/shrink<g>/comm``.

The store must outlive the lost rank (hosted by the launcher or by a survivor): when it
does not answer, shrink raises ``StoreLostError`` saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import ClosedError, PlaitError, ShrinkExcludedError, StoreLostError, where
from .health import Health
from .rendezvous import Meeting

C = TypeVar("C")

POLL_MIN_S = 0.001
POLL_MAX_S = 0.02
HARD_MARGIN_S = 1.0
"""A rank that waits for a decision past twice the timeout (plus this) decides itself."""


@dataclass(frozen=True)
class Decision:
    """What the survivors agreed on (ranks numbered in the communicator that shrank)."""

    members: tuple[int, ...]  # in the new communicator's order: new rank i is members[i]
    last_seq: int  # the last collective completed on every member
    lost: tuple[int, ...]  # dead, or not joined within the timeout
    excluded: tuple[int, ...]  # dropped by some survivor's ``exclude``
    by: int  # the rank that wrote the decision

    def encode(self) -> str:
        return json.dumps({"members": self.members, "last_seq": self.last_seq,
                           "lost": self.lost, "excluded": self.excluded, "by": self.by})

    @classmethod
    def decode(cls, raw: bytes) -> Decision:
        d = json.loads(bytes(raw).decode())
        return cls(tuple(d["members"]), int(d["last_seq"]), tuple(d["lost"]),
                   tuple(d["excluded"]), int(d["by"]))


@dataclass(frozen=True)
class ShrinkResult(Generic[C]):
    """What ``Communicator.shrink`` returns."""

    comm: C  # the new communicator: the members, renumbered in order
    ranks: tuple[int, ...]  # the old rank of each new rank
    last_seq: int  # the last collective of the old communicator completed on every member
    lost: tuple[int, ...]  # old ranks lost: dead, or not joined within the timeout
    excluded: tuple[int, ...]  # old ranks dropped by ``exclude``


def check_exclude(exclude: Iterable[Any] | None, size: int, rank: int) -> frozenset[int]:
    if exclude is None:
        return frozenset()
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise TypeError(f"rank {rank}, shrink: exclude must be a sequence of ranks, not "
                        f"{exclude!r}")
    out = set()
    for r in exclude:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size:
            raise ValueError(f"rank {rank}, shrink: exclude entry {r!r} is not a rank of "
                             f"this communicator (0..{size - 1})")
        out.add(r)
    return frozenset(out)


def shrink_communicator(health: Health, completed: int, gen: int, exclude: Iterable[Any] | None,
           timeout: float, derive: Callable[[Sequence[int], str], C]) -> ShrinkResult[C]:
    """Agree with the other survivors (see the module docstring), then derive the new
    communicator with ``derive(members, tag)``."""
    rank, size = health.rank, health.group.size
    what = where(rank, "shrink", gen)
    excl = check_exclude(exclude, size, rank)
    meet = health.meet
    if meet is None:
        raise ClosedError(f"{what}: the communicator is closed; shrink it before closing")
    d = _Agreement(health, meet.child(f"shrink{gen}/agree"), what, timeout).run(
        completed, excl)
    if rank not in d.members:
        why = ("excluded by a survivor's exclude list" if rank in d.excluded else
               "it did not join within the timeout, or was known to be lost")
        raise ShrinkExcludedError(
            f"{what}: this rank is not in the shrunk communicator ({why}); members: ranks "
            f"{', '.join(map(str, d.members)) or 'none'} (decided by rank {d.by})",
            rank, d.members)
    comm = derive(d.members, f"shrink{gen}/comm")
    return ShrinkResult(comm, d.members, d.last_seq, d.lost, d.excluded)


class _Agreement:
    """One rank's side of one shrink's agreement."""

    def __init__(self, health: Health, meet: Meeting, what: str, timeout: float) -> None:
        self.health = health
        self.meet = meet
        self.what = what
        self.rank = health.rank
        self.size = health.group.size
        self.timeout = timeout
        self.joined: dict[int, dict[str, Any]] = {}

    def run(self, completed: int, exclude: frozenset[int]) -> Decision:
        try:
            return self._run(completed, exclude)
        except PlaitError:
            raise
        except Exception as exc:  # the store's client: the store is gone
            raise StoreLostError(
                f"{self.what}: the rendezvous store is unreachable ({type(exc).__name__}: "
                f"{exc}); shrink needs a store that outlives the lost rank: host it in the "
                "launcher (torchrun's agent, the parent process) or on a rank that "
                "survives, not on a rank that may fail (rank 0 hosts the store plait "
                "makes from MASTER_ADDR/MASTER_PORT)") from exc

    def _run(self, completed: int, exclude: frozenset[int]) -> Decision:
        start = time.monotonic()
        deadline = start + self.timeout
        hard = start + 2 * self.timeout + HARD_MARGIN_S
        mine = {"seq": completed, "exclude": sorted(exclude),
                "lost": sorted(self.health.lost_ranks())}
        self.meet.set(f"join/{self.rank}", json.dumps(mine))
        self.joined[self.rank] = mine
        delay = POLL_MIN_S
        while True:
            if self.meet.check("decision"):
                return Decision.decode(self.meet.get("decision", self.timeout))
            self._scan()
            excl = set().union(*(j["exclude"] for j in self.joined.values()))
            lost = self.health.lost_ranks().union(*(j["lost"] for j in self.joined.values()))
            now = time.monotonic()
            late = now >= deadline
            joined = set(self.joined)
            alive = joined if late else (set(range(self.size)) - lost) | joined
            candidates = alive - excl
            missing = [r for r in range(self.size)
                       if r not in joined and r not in lost and r not in excl]
            decider = min(candidates) if candidates else self.rank
            if (decider == self.rank and (late or not missing)) or now >= hard:
                return self._decide(excl)
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _scan(self) -> None:
        for r in range(self.size):
            if r not in self.joined and self.meet.check(f"join/{r}"):
                self.joined[r] = json.loads(self.meet.get(f"join/{r}", self.timeout).decode())

    def _decide(self, excl: set[int]) -> Decision:
        dead = self.health.dead_ranks()
        members = tuple(sorted(r for r in self.joined if r not in excl and r not in dead))
        mine = Decision(
            members=members,
            last_seq=min((int(self.joined[r]["seq"]) for r in members), default=0),
            lost=tuple(r for r in range(self.size) if r not in members and r not in excl),
            excluded=tuple(sorted(excl)), by=self.rank)
        key = self.meet.key("decision")
        return Decision.decode(self.meet.store.compare_set(key, "", mine.encode()))
