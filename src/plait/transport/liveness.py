"""Whether a peer process on this host is still alive, without being fooled.

``os.kill(pid, 0)`` answers a different question: whether *some* process has that number.
It succeeds on a zombie (a peer that was killed but that its parent, say the launcher, has
not reaped yet), so a dead rank looks alive until the launcher gets round to it; and once
the number is freed the kernel may give it to an unrelated process, which then looks like
the peer forever.

A :class:`ProcessWatch` is opened while the peer is known to be alive (when it attaches)
and from then on refers to that process, not to its number:

- ``pidfd``: ``os.pidfd_open`` (Linux 5.3+) gives a descriptor bound to the process
  itself. It becomes readable as soon as the process exits, reaped or not, and a later
  process that gets the same number is a different process, so it cannot make it look
  alive. The descriptor can go into the caller's own ``select``/``poll`` set.
- ``proc``: where ``pidfd_open`` is missing or refused (old kernel, a seccomp filter,
  no descriptors left), ``/proc/<pid>/stat`` is read instead. Its start time (field 22,
  clock ticks since boot) is recorded at open; the process is dead once the file is
  gone, its state is Z (zombie) or X (dead), or its start time differs (the number was
  reused).

Both mechanisms also accept the start time the peer itself published (see
:func:`start_time_of`), which closes the one gap left: a peer that died, and whose number
was reused, between publishing its pid and the watcher opening it.

A :class:`PeerWatch` holds the watches of several peers and answers "who has died" with
one ``poll`` call over all descriptors, cheap enough for every pass of a wait loop.
Neither class is thread-safe: one thread at a time (a ``select.poll`` object refuses
concurrent use).
"""

from __future__ import annotations

import errno
import os
import select
from typing import Literal

from ..errors import PlaitError

How = Literal["pidfd", "proc"]

# pidfd_open refused in a way that says "use something else", not "no such process"
_FALLBACK_ERRNOS = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL,
                              errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# a process that has gone (or is going) while its stat file is read
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
_DEAD_STATES = frozenset({"Z", "X", "x"})
_proc_mounted: bool | None = None


def _read_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` from ``/proc/<pid>/stat``, or None if there is no such process."""
    try:
        # os.open/os.read rather than open(): no buffered file object, a few µs cheaper
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _GONE_ERRNOS:
            return None
        raise
    try:
        data = os.read(fd, 4096)
    except OSError as e:
        if e.errno in _GONE_ERRNOS:
            return None
        raise
    finally:
        os.close(fd)
    # the command name (field 2) is in parentheses and may itself hold spaces and ')',
    # so split after the last ')': what follows starts at field 3 (state)
    rest = data[data.rindex(b")") + 2:].split()
    return rest[0].decode(), int(rest[19])


def _have_proc() -> bool:
    # checked once: without /proc the fallback could not tell a dead process from no /proc
    global _proc_mounted
    if _proc_mounted is None:
        _proc_mounted = os.path.exists("/proc/self/stat")
    return _proc_mounted


def start_time_of(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None if it has gone.

    A peer can publish ``start_time_of(os.getpid())`` next to its pid; a watcher that
    passes it to :meth:`ProcessWatch.open` then cannot mistake a later process with the
    same number for it.
    """
    st = _read_stat(pid) if _have_proc() else None
    return None if st is None else st[1]


class ProcessWatch:
    """One peer process, watched through a pidfd or through ``/proc/<pid>/stat``.

    Make it with :meth:`open`. ``how`` says which mechanism it uses. Once it has seen the
    process dead it stays dead (a process does not come back).
    """

    __slots__ = ("_dead", "_fd", "_poll", "closed", "how", "pid", "start_time")

    def __init__(self, pid: int, how: How, fd: int | None, start_time: int | None,
                 dead: bool) -> None:
        self.pid = pid
        self.how: How = how
        self.start_time = start_time
        self.closed = False
        self._fd = fd
        self._dead = dead
        # a poll object holds no descriptor of its own (unlike epoll), so one per watch
        # costs nothing to keep and saves making one on every alive()
        self._poll: select.poll | None = None
        if fd is not None:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    @classmethod
    def open(cls, pid: int, *, start_time: int | None = None,
             use_pidfd: bool = True) -> ProcessWatch:
        """Watch process ``pid``; call it while that process is known to be alive.

        ``start_time``: the process's start time as it published it (:func:`start_time_of`);
        a process with that number but another start time counts as dead. Without it,
        the proc mechanism records the start time it finds now. ``use_pidfd=False``
        forces the proc mechanism. A process that is already dead, or never existed,
        gives a watch whose :meth:`alive` is False; nothing is raised for it.
        """
        if pid <= 0:
            # 0 and negative numbers name process groups to kill(), never one process
            raise ValueError(f"not a process id: {pid}")
        pidfd_open = getattr(os, "pidfd_open", None) if use_pidfd else None
        if pidfd_open is not None:
            try:
                fd = pidfd_open(pid)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    return cls(pid, "pidfd", None, start_time, True)
                if e.errno not in _FALLBACK_ERRNOS:
                    raise
            else:
                return cls._checked_pidfd(pid, fd, start_time)
        return cls._opened_proc(pid, start_time)

    @classmethod
    def _checked_pidfd(cls, pid: int, fd: int, start_time: int | None) -> ProcessWatch:
        dead = False
        if start_time is not None and _have_proc():
            # read after the pidfd is open: if the number held another process when it
            # was opened, /proc shows that process's start time now; if the peer has died
            # since, the pidfd says so. Either way the mismatch or the pidfd is right.
            try:
                st = _read_stat(pid)
            except BaseException:
                os.close(fd)
                raise
            dead = st is None or st[1] != start_time
        return cls(pid, "pidfd", fd, start_time, dead)

    @classmethod
    def _opened_proc(cls, pid: int, start_time: int | None) -> ProcessWatch:
        if not _have_proc():
            raise PlaitError(f"cannot watch pid {pid}: os.pidfd_open is unavailable and "
                             "/proc is not mounted")
        st = _read_stat(pid)
        if st is None:
            return cls(pid, "proc", None, start_time, True)
        state, now = st
        if start_time is None:
            start_time = now
        return cls(pid, "proc", None, start_time, state in _DEAD_STATES or now != start_time)

    def alive(self) -> bool:
        """Whether the process still runs; never blocks."""
        if self.closed:
            raise ValueError(f"watch of pid {self.pid} is closed")
        if self._dead:
            return False
        if self._poll is not None:
            # readable (POLLIN) once it has exited; POLLHUP once it has also been reaped
            if self._poll.poll(0):
                self._dead = True
        else:
            st = _read_stat(self.pid)
            if st is None or st[0] in _DEAD_STATES or st[1] != self.start_time:
                self._dead = True
        return not self._dead

    def fileno(self) -> int | None:
        """The pidfd (readable once the process exits), None for the proc mechanism or a
        process that was dead at open."""
        return self._fd

    def close(self) -> None:
        """Close the pidfd; calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        fd, self._fd, self._poll = self._fd, None, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> ProcessWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # a watch dropped without close() must not leak its descriptor
        if not getattr(self, "closed", True):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "dead" if self._dead else "watching"
        return f"ProcessWatch(pid={self.pid}, how={self.how!r}, {state})"


class PeerWatch:
    """The watches of several peers (keyed by rank, or any int), polled together."""

    def __init__(self, use_pidfd: bool = True) -> None:
        self.use_pidfd = use_pidfd
        self._watches: dict[int, ProcessWatch] = {}
        self._by_fd: dict[int, int] = {}  # pidfd -> peer
        self._no_fd: dict[int, ProcessWatch] = {}  # proc watches and dead-at-open ones
        self._poll = select.poll()

    def add(self, peer: int, pid: int, start_time: int | None = None) -> ProcessWatch:
        """Watch ``pid`` as ``peer`` (replacing any earlier watch of that peer); call it
        while the process is known to be alive. See :meth:`ProcessWatch.open`."""
        self.remove(peer)
        watch = ProcessWatch.open(pid, start_time=start_time, use_pidfd=self.use_pidfd)
        self._watches[peer] = watch
        fd = watch.fileno()
        # a watch already dead at open (start time mismatch) keeps its pidfd, but poll()
        # would not report it, so it goes with the ones alive() is asked about
        if fd is None or not watch.alive():
            self._no_fd[peer] = watch
        else:
            self._by_fd[fd] = peer
            self._poll.register(fd, select.POLLIN)
        return watch

    def remove(self, peer: int) -> None:
        """Stop watching ``peer`` and close its watch; nothing happens if it is not watched."""
        watch = self._watches.pop(peer, None)
        if watch is None:
            return
        self._no_fd.pop(peer, None)
        fd = watch.fileno()
        if fd is not None and self._by_fd.pop(fd, None) is not None:
            self._poll.unregister(fd)
        watch.close()

    def dead(self) -> list[int]:
        """The watched peers whose process has exited, in increasing order; never blocks.

        A dead peer stays in the list on every call until it is removed.
        """
        out = [self._by_fd[fd] for fd, _ in self._poll.poll(0)] if self._by_fd else []
        out.extend(p for p, w in self._no_fd.items() if not w.alive())
        out.sort()
        return out

    def pids(self) -> dict[int, int]:
        """Peer -> watched pid, for messages."""
        return {p: w.pid for p, w in self._watches.items()}

    def __contains__(self, peer: object) -> bool:
        return peer in self._watches

    def __len__(self) -> int:
        return len(self._watches)

    def close(self) -> None:
        """Close every watch; calling it again does nothing."""
        for peer in list(self._watches):
            self.remove(peer)

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PeerWatch", "ProcessWatch", "start_time_of"]
