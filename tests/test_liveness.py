"""plait.transport.liveness against real processes: live, zombie, reaped, reused number."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from plait.errors import PlaitError
from plait.transport import liveness
from plait.transport.liveness import PeerWatch, ProcessWatch, start_time_of

HAVE_PIDFD = hasattr(os, "pidfd_open")
needs_pidfd = pytest.mark.skipif(not HAVE_PIDFD, reason="os.pidfd_open is unavailable")
MODES = [pytest.param(True, id="pidfd", marks=needs_pidfd), pytest.param(False, id="proc")]

Spawn = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start sleeping children; every one is killed and reaped at teardown, pass or fail."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.returncode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data[data.rindex(b")") + 2:].split()[0].decode()


def make_zombie(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``p`` and wait until it is a zombie, without reaping it (no poll()/wait())."""
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(p.pid) != "Z":
        assert time.monotonic() < deadline, f"pid {p.pid} never became a zombie"
        time.sleep(0.005)


def wait_dead(w: ProcessWatch) -> bool:
    # the kernel marks the exit a moment after the signal; give it a bounded while
    deadline = time.monotonic() + 10
    while w.alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("use_pidfd", MODES)
def test_live_child_is_alive(spawn: Spawn, use_pidfd: bool) -> None:
    p = spawn()
    with ProcessWatch.open(p.pid, use_pidfd=use_pidfd) as w:
        assert w.how == ("pidfd" if use_pidfd else "proc")
        assert w.alive()
        assert w.alive()  # asking again changes nothing
        assert (w.fileno() is not None) == use_pidfd


@pytest.mark.parametrize("use_pidfd", MODES)
def test_zombie_is_dead(spawn: Spawn, use_pidfd: bool) -> None:
    p = spawn()
    with ProcessWatch.open(p.pid, use_pidfd=use_pidfd) as w:
        assert w.alive()
        make_zombie(p)
        assert _state(p.pid) == "Z"
        # os.kill(pid, 0) is what this replaces: it still says "exists"
        os.kill(p.pid, 0)
        assert wait_dead(w)
        assert p.returncode is None  # still not reaped
    # a zombie at open time is dead too, from the start
    with ProcessWatch.open(p.pid, use_pidfd=use_pidfd) as w2:
        assert not w2.alive()


def test_fallback_when_pidfd_open_refused(spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open: function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refuse, raising=False)
    p = spawn()
    with ProcessWatch.open(p.pid) as w:
        assert w.how == "proc" and w.fileno() is None
        assert w.alive()
        make_zombie(p)
        assert not w.alive()


def test_fallback_when_pidfd_open_missing(spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    p = spawn()
    with ProcessWatch.open(p.pid) as w:
        assert w.how == "proc" and w.alive()


def test_other_pidfd_errors_raise(spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(pid: int, flags: int = 0) -> int:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "pidfd_open", broken, raising=False)
    with pytest.raises(OSError):
        ProcessWatch.open(spawn().pid)


@pytest.mark.parametrize("use_pidfd", MODES)
def test_reused_pid_by_start_time(spawn: Spawn, use_pidfd: bool) -> None:
    # A watch that knows the start time of the process it means sees the process now
    # holding that number as someone else: as if the peer had died and its pid been reused.
    p = spawn()
    real = start_time_of(p.pid)
    assert real is not None
    with ProcessWatch.open(p.pid, start_time=real, use_pidfd=use_pidfd) as w:
        assert w.alive()
    with ProcessWatch.open(p.pid, start_time=real - 1, use_pidfd=use_pidfd) as w:
        assert w.start_time == real - 1
        assert not w.alive()
        os.kill(p.pid, 0)  # the number is taken by a live process, and it is not ours


def test_proc_watch_records_start_time(spawn: Spawn) -> None:
    p = spawn()
    with ProcessWatch.open(p.pid, use_pidfd=False) as w:
        assert w.start_time == start_time_of(p.pid)


@needs_pidfd
def test_pidfd_of_reaped_process_stays_dead(spawn: Spawn) -> None:
    p = spawn()
    w = ProcessWatch.open(p.pid)
    try:
        fd = w.fileno()
        assert fd is not None
        p.kill()
        p.wait()  # reaped: the number is free for the kernel to hand out again
        assert not w.alive()
        # the descriptor is bound to the exited process, not to the number: new
        # processes (any of which could be given that number) do not revive it
        for _ in range(3):
            spawn()
        assert not w.alive()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(0)  # what a caller polling fileno() itself sees
    finally:
        w.close()


@pytest.mark.parametrize("use_pidfd", MODES)
def test_reaped_or_never_existed_at_open(spawn: Spawn, use_pidfd: bool) -> None:
    p = spawn()
    p.kill()
    p.wait()
    with open("/proc/sys/kernel/pid_max") as f:
        never = int(f.read()) + 1  # no process can have a number above pid_max
    with ProcessWatch.open(never, use_pidfd=use_pidfd) as w:
        assert not w.alive()
    # a reaped child's number opens without error; whether it is alive depends on whether
    # the kernel has already given the number to someone else, so only opening is checked
    ProcessWatch.open(p.pid, use_pidfd=use_pidfd).close()


def test_bad_pid_raises() -> None:
    for pid in (0, -1):
        with pytest.raises(ValueError):
            ProcessWatch.open(pid)


@pytest.mark.parametrize("use_pidfd", MODES)
def test_close_idempotent_no_leak(spawn: Spawn, use_pidfd: bool) -> None:
    p = spawn()
    before = open_fds()
    w = ProcessWatch.open(p.pid, use_pidfd=use_pidfd)
    assert open_fds() == before + (1 if use_pidfd else 0)
    w.close()
    w.close()
    assert open_fds() == before
    assert w.fileno() is None
    with pytest.raises(ValueError):
        w.alive()


@pytest.mark.parametrize("use_pidfd", MODES)
def test_peerwatch_lists_exactly_the_killed(spawn: Spawn, use_pidfd: bool) -> None:
    procs = [spawn() for _ in range(5)]
    before = open_fds()
    pw = PeerWatch(use_pidfd=use_pidfd)
    try:
        for peer, p in enumerate(procs):
            pw.add(peer, p.pid)
        assert len(pw) == 5 and 3 in pw and 9 not in pw
        assert pw.pids() == {peer: p.pid for peer, p in enumerate(procs)}
        assert pw.dead() == []
        make_zombie(procs[1])  # a zombie ...
        procs[3].kill()  # ... and a reaped one
        procs[3].wait()
        deadline = time.monotonic() + 10
        while pw.dead() != [1, 3]:
            assert time.monotonic() < deadline, pw.dead()
            time.sleep(0.005)
        assert pw.dead() == [1, 3]  # stays reported
        pw.remove(3)
        pw.remove(3)  # removing again (or an unknown peer) does nothing
        assert pw.dead() == [1]
        # a dead-at-open peer is reported too
        pw.add(7, procs[1].pid)
        assert pw.dead() == [1, 7]
        # re-adding a peer replaces its watch without leaking the old one
        pw.add(0, procs[0].pid)
        pw.add(0, procs[0].pid)
        assert pw.dead() == [1, 7]
    finally:
        pw.close()
    pw.close()
    assert len(pw) == 0 and pw.dead() == []
    assert open_fds() == before


@needs_pidfd
def test_peerwatch_start_time_mismatch_is_dead(spawn: Spawn) -> None:
    p = spawn()
    real = start_time_of(p.pid)
    assert real is not None
    with PeerWatch() as pw:
        pw.add(0, p.pid, start_time=real)
        pw.add(1, p.pid, start_time=real + 1)
        assert pw.dead() == [1]


def test_start_time_of_self_and_gone(spawn: Spawn) -> None:
    mine = start_time_of(os.getpid())
    assert isinstance(mine, int) and mine > 0
    p = spawn()
    p.kill()
    p.wait()
    with open("/proc/sys/kernel/pid_max") as f:
        assert start_time_of(int(f.read()) + 1) is None


def test_no_proc_and_no_pidfd_raises(spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "_proc_mounted", False)
    with pytest.raises(PlaitError):
        ProcessWatch.open(spawn().pid, use_pidfd=False)


# The middle process starts the watched one and reaps it only when its stdin closes, so the
# watched process is a zombie of someone else's, as a killed peer is of the launcher's.
_MIDDLE = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(p.pid, flush=True)
sys.stdin.read()
p.kill()
p.wait()
"""


@pytest.mark.parametrize("use_pidfd", MODES)
def test_zombie_of_another_parent_is_dead(use_pidfd: bool) -> None:
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert middle.stdin is not None and middle.stdout is not None
    pid = 0
    try:
        pid = int(middle.stdout.readline())
        with ProcessWatch.open(pid, use_pidfd=use_pidfd) as w:
            assert w.alive()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _state(pid) != "Z":
                assert time.monotonic() < deadline, f"pid {pid} never became a zombie"
                time.sleep(0.005)
            assert wait_dead(w)
    finally:
        middle.stdin.close()  # the middle process now reaps (killing it first if need be)
        try:
            middle.wait(timeout=10)
        except subprocess.TimeoutExpired:
            if pid and _state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
            middle.kill()
            middle.wait()
        middle.stdout.close()
