"""A multi-process test harness: persistent rank processes that run test cases.

A :class:`Pool` is a world of ``size`` real rank processes, each holding a communicator
made by ``plait.init`` under one configuration (transport, fake host ids, settings). A
test sends a *case*, an importable function ``fn(comm, *args, **kwargs)``; every rank
runs it and :meth:`Pool.run` returns the list of per-rank return values::

    pools = PoolSet()                              # or the ``pools`` fixture of tests/
    pool = pools.get(4, "tcp")                     # 4 ranks, TCP between every pair
    results = pool.run(case_allreduce, 1000, "float32")   # [value of rank 0, 1, 2, 3]

Processes are expensive here (importing torch costs 1-2 s of CPU per process on a
2-core machine), so rank processes are reused: every pool of a :class:`PoolSet` runs on
the same worker processes, and switching pools closes the communicators and calls
``plait.init`` again with the other configuration (plait reads its ``PLAIT_*`` settings
at init, so the worker sets ``os.environ`` first). Rendezvous goes through a TCPStore
hosted by the test process on a port the OS picks; each init uses a fresh key prefix.

Failing fast (as PyTorch's ``MultiProcessTestCase``): when a rank raises or dies, the
others get a short grace period, then every rank still running has its threads' stacks
dumped (faulthandler on SIGUSR1) and is killed (by PID; only processes this harness
started), and :class:`RankFailure` reports each rank's traceback, stacks and output.
The same happens at the per-case deadline. The next case restarts the processes.

Cases that expect an error catch it themselves (``pytest.raises`` inside the case): any
exception escaping a case fails the test. A case that leaves the communicators out of
step on purpose (a timeout test) passes ``reset_after=True``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

TEST_SETTINGS: dict[str, str] = {
    # shrunk so that "larger than a slot / chunk / ring" costs a few KiB
    "PLAIT_SHM_SLOT_SIZE": "1K",
    "PLAIT_SHM_CHUNK_SIZE": "4K",
    "PLAIT_SHM_RING_CHUNKS": "4",
    "PLAIT_TCP_CHUNK_SIZE": "4K",
}
"""Settings every pool starts from (a pool's ``env`` overrides them)."""

SLOT_BYTES = 1024
CHUNK_BYTES = 4096
BIG_COUNT = 3000
"""An element count larger than the shrunk slot, chunk and shared-memory ring (float32)."""

DEFAULT_DEADLINE = 60.0
DEFAULT_TIMEOUT = 30.0
"""The communicators' own timeout: below the deadline, so a hang usually reports the
library's CommTimeoutError from every waiting rank rather than a stack dump."""
INIT_DEADLINE = 120.0
GRACE = 1.0
"""Seconds the other ranks get to finish after one rank failed."""

TRANSPORTS = ("shm", "tcp", "mixed")

# variables of launchers and of plait itself that must not leak from the environment
# pytest runs in (tests may run under Slurm or torchrun) into the rank processes
_ENV_PREFIXES = ("PLAIT_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankFailure(AssertionError):
    """A case failed on at least one rank (raised, died, or missed the deadline)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (for tests of MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_environ() -> dict[str, str]:
    """``os.environ`` without launcher and plait variables, for rank processes."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_ENV_PREFIXES) and k not in _ENV_NAMES}
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: no torch thread pools per rank
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def shm_entries(prefix: str = "plait") -> set[str]:
    """Names in /dev/shm that start with ``prefix``."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def host_ids(size: int) -> list[str]:
    """The "mixed" layout: two fake hosts, the first ``size // 2`` ranks on host A."""
    half = size // 2
    return ["hostA" if r < half else "hostB" for r in range(size)]


@dataclass(frozen=True)
class RankInfo:
    """What a case receives instead of a communicator when a pool has ``init=False``."""

    rank: int
    size: int


# --------------------------------------------------------------------------- worker side


class _WorkerState:
    def __init__(self) -> None:
        self.base_env = dict(os.environ)
        self.comm: Any = None
        self.store: Any = None
        self.store_addr: tuple[str, int] | None = None

    def init(self, rank: int, size: int, env: Mapping[str, str], mode: str,
             store_addr: tuple[str, int] | None, prefix: str, timeout: float | None,
             sys_path: Sequence[str]) -> str:
        self.close()
        for p in reversed(sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        # the harness, not plait, writes the environment: plait reads it at init
        os.environ.clear()
        os.environ.update(self.base_env)
        os.environ.update(env)
        if mode == "none":
            self.comm = RankInfo(rank, size)
            return "none"
        import plait

        if mode == "launcher":
            self.comm = plait.init(timeout=timeout)
        else:
            import torch.distributed as dist

            if self.store is None or self.store_addr != store_addr:
                assert store_addr is not None
                self.store = dist.TCPStore(store_addr[0], store_addr[1], is_master=False,
                                           timeout=_timedelta(INIT_DEADLINE))
                self.store_addr = store_addr
            store = dist.PrefixStore(prefix, self.store)
            self.comm = plait.init(rank, size, store=store, timeout=timeout)
        return f"{self.comm.rank}/{self.comm.size}"

    def run(self, module: str, qualname: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        return fn(self.comm, *args, **kwargs)

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and not isinstance(comm, RankInfo):
            comm.close()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _set_pdeathsig() -> None:
    """Die with the test process, even if it is SIGKILLed (Linux prctl)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def _worker_main(fd: int) -> None:
    """Entry point of a rank process: serve messages until told to exit or EOF."""
    _set_pdeathsig()
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn = Connection(fd)
    state = _WorkerState()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        kind = msg[0]
        try:
            if kind == "init":
                value = state.init(**msg[1])
            elif kind == "run":
                value = state.run(*msg[1:])
            elif kind == "close":
                value = state.close()
            elif kind == "exit":
                state.close()
                conn.send(("ok", None))
                _exit_now()
            else:
                raise ValueError(f"unknown message {kind!r}")
            reply: tuple[Any, ...] = ("ok", value)
        except BaseException as exc:
            reply = ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result: nothing was written yet
            conn.send(("err", f"result not picklable: {exc!r}", traceback.format_exc()))
    with contextlib.suppress(Exception):
        state.close()
    _exit_now()


def _exit_now() -> None:
    """Exit without interpreter finalization: with torch loaded it costs 1-2 s of CPU
    per process here, and the communicator is already closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- test side


class _Worker:
    """One rank process and its end of the message pipe."""

    def __init__(self, index: int, logdir: str, env: Mapping[str, str]) -> None:
        self.index = index
        self.logpath = os.path.join(logdir, f"worker{index}.log")
        self.log = open(self.logpath, "ab")  # open while the worker lives
        parent, child = socket.socketpair()
        code = ("import sys; from plait.testing.harness import _worker_main; "
                "_worker_main(int(sys.argv[1]))")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(child.fileno())], pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=dict(env))
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.pool: Pool | None = None  # whose communicator this process holds
        self.generation = -1

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_offset(self) -> int:
        self.log.flush()
        return os.path.getsize(self.logpath)

    def log_since(self, offset: int, limit: int = 12000) -> str:
        with open(self.logpath, "rb") as f:
            f.seek(offset)
            data = f.read()
        text = data.decode(errors="replace")
        if len(text) > limit:
            text = "[...]\n" + text[-limit:]
        return text

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.conn.close()
        self.log.close()


@dataclass
class _Reply:
    status: str  # ok | error | died | hung | skipped
    value: Any = None
    text: str = ""


@dataclass
class _Workers:
    """The rank processes shared by the pools of one PoolSet (or owned by one pool)."""

    logdir: str
    env: dict[str, str] = field(default_factory=clean_environ)
    procs: list[_Worker | None] = field(default_factory=list)
    count: itertools.count = field(default_factory=itertools.count)
    started: int = 0
    close_failures: list[str] = field(default_factory=list)
    """Reports of ``Communicator.close`` calls that failed while switching pools."""

    def get(self, n: int) -> list[_Worker]:
        while len(self.procs) < n:
            self.procs.append(None)
        out = []
        for i in range(n):
            w = self.procs[i]
            if w is None or not w.alive():
                if w is not None:
                    w.kill()
                w = _Worker(i, self.logdir, self.env)
                self.procs[i] = w
                self.started += 1
            out.append(w)
        return out

    def kill(self, workers: Sequence[_Worker]) -> None:
        for w in workers:
            w.kill()
            if w.index < len(self.procs) and self.procs[w.index] is w:
                self.procs[w.index] = None

    def shutdown(self) -> None:
        live = [w for w in self.procs if w is not None]
        for w in live:  # ask all first, so they close concurrently
            with contextlib.suppress(Exception):
                w.conn.send(("exit",))
        deadline = time.monotonic() + 10
        for w in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(max(deadline - time.monotonic(), 0.1))
            w.kill()
        self.procs = []

    def pids(self) -> list[int]:
        return [w.pid for w in self.procs if w is not None and w.alive()]


class Pool:
    """``size`` rank processes with communicators made under one configuration.

    transport: ``"shm"`` (one host: shared memory), ``"tcp"`` (``PLAIT_TRANSPORT=tcp``)
    or ``"mixed"`` (two fake hosts via ``PLAIT_HOST_ID``, see :func:`host_ids`).
    env: extra variables for every rank (``{rank}`` and ``{size}`` in values are
    formatted per rank). hosts: explicit ``PLAIT_HOST_ID`` per rank. init: ``"store"``
    (``plait.init(rank, size, store=...)``), ``"launcher"`` (``plait.init()`` from the
    variables in ``env``) or ``"none"`` (cases get a :class:`RankInfo`).
    """

    def __init__(self, size: int, transport: str = "shm", *, env: Mapping[str, str] | None = None,
                 hosts: Sequence[str] | None = None, init: str = "store",
                 timeout: float | None = DEFAULT_TIMEOUT, workers: _Workers | None = None,
                 store: Any = None, name: str | None = None) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}")
        if init not in ("store", "launcher", "none"):
            raise ValueError("init must be store, launcher or none")
        self.size = size
        self.transport = transport
        self.init_mode = init
        self.timeout = timeout
        self.extra_env = dict(env or {})
        if hosts is None and transport == "mixed":
            hosts = host_ids(size)
        self.hosts = list(hosts) if hosts is not None else None
        self.name = name or f"{transport}-{size}"
        self._own_workers = workers is None
        self._workers = workers or _Workers(tempfile.mkdtemp(prefix="plait-harness-"))
        self._store = store
        self._generation = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"Pool({self.name})"

    # -- configuration

    def rank_env(self, rank: int) -> dict[str, str]:
        env = dict(TEST_SETTINGS)
        if self.transport == "tcp":
            env["PLAIT_TRANSPORT"] = "tcp"
        if self.hosts is not None:
            env["PLAIT_HOST_ID"] = self.hosts[rank]
        if self.timeout is not None:
            env["PLAIT_TIMEOUT"] = str(self.timeout)
        for k, v in self.extra_env.items():
            env[k] = str(v).format(rank=rank, size=self.size)
        return env

    def _store_addr(self) -> tuple[str, int] | None:
        if self.init_mode != "store":
            return None
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                        wait_for_workers=False,
                                        timeout=_timedelta(INIT_DEADLINE))
        return ("127.0.0.1", int(self._store.port))

    def _ready(self) -> list[_Worker]:
        """The rank processes, with this pool's communicators (re-initialised if needed)."""
        if self._closed:
            raise RuntimeError(f"{self} is closed")
        workers = self._workers.get(self.size)
        if all(w.pool is self and w.generation == self._generation for w in workers):
            return workers
        # close whatever communicators the processes hold (any pool's), then init ours
        holders = [w for w in self._workers.procs if w is not None and w.pool is not None]
        if holders:
            try:
                self._exchange(holders, [("close",)] * len(holders), "Communicator.close",
                               DEFAULT_DEADLINE)
            except RankFailure as exc:  # the processes were killed; remember why
                self._workers.close_failures.append(str(exc))
            for w in holders:
                w.pool = None
            workers = self._workers.get(self.size)
        self._generation += 1
        prefix = f"plait-test/{next(self._workers.count)}"
        addr = self._store_addr()
        msgs = [("init", {"rank": r, "size": self.size, "env": self.rank_env(r),
                          "mode": self.init_mode, "store_addr": addr, "prefix": prefix,
                          "timeout": self.timeout, "sys_path": list(sys.path)})
                for r in range(self.size)]
        self._exchange(workers, msgs, "plait.init", INIT_DEADLINE)
        for w in workers:
            w.pool = self
            w.generation = self._generation
        return workers

    def reset(self) -> None:
        """Make the next case start from freshly initialised communicators."""
        self._generation += 1

    # -- running cases

    def run(self, fn: Callable[..., Any], *args: Any, deadline: float = DEFAULT_DEADLINE,
            reset_after: bool = False, may_die: Sequence[int] = (), **kwargs: Any,
            ) -> list[Any]:
        """Run ``fn(comm, *args, **kwargs)`` on every rank; the per-rank return values.

        ``reset_after``: the next case gets fresh communicators. ``may_die``: ranks that
        are expected to exit (their value is None; implies ``reset_after``).
        """
        module, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname:
            raise ValueError(f"{qualname}: cases must be module-level functions")
        workers = self._ready()
        what = f"{module}.{qualname}{_short_args(args, kwargs)}"
        try:
            return self._exchange(workers, [("run", module, qualname, args, kwargs)]
                                  * self.size, what, deadline, may_die=may_die)
        finally:
            if reset_after or may_die:
                self.reset()

    def _exchange(self, workers: Sequence[_Worker], msgs: Sequence[tuple[Any, ...]],
                  what: str, deadline: float, may_die: Sequence[int] = ()) -> list[Any]:
        """Send one message per worker and collect the replies, failing fast."""
        offsets = [w.log_offset() for w in workers]
        replies: dict[int, _Reply] = {}
        for i, (w, m) in enumerate(zip(workers, msgs, strict=True)):
            try:
                w.conn.send(m)
            except OSError as exc:
                replies[i] = _Reply("died", text=f"could not send the case: {exc!r}")
        start = time.monotonic()
        end = start + deadline
        grace_end: float | None = None
        if replies:
            grace_end = time.monotonic() + GRACE
        pending = {w.conn: i for i, w in enumerate(workers) if i not in replies}
        while pending:
            now = time.monotonic()
            limit = end if grace_end is None else min(end, grace_end)
            if now >= limit:
                break
            for conn in wait(list(pending), timeout=limit - now):
                i = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    msg = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        workers[i].proc.wait(5)
                    replies[i] = _Reply("died", text=f"process exited with code "
                                        f"{workers[i].proc.returncode}")
                else:
                    if msg[0] == "ok":
                        replies[i] = _Reply("ok", msg[1])
                    else:
                        replies[i] = _Reply("error", msg[1], msg[2])
                if replies[i].status == "died" and i in may_die:
                    replies[i] = _Reply("ok", None)
                    # reaped, and forgotten: the next case starts a new process (a dead
                    # worker left in the list would be asked to close its communicator)
                    self._workers.kill([workers[i]])
                if replies[i].status != "ok" and grace_end is None:
                    grace_end = time.monotonic() + GRACE
        if not pending and all(r.status == "ok" for r in replies.values()):
            return [replies[i].value for i in range(len(workers))]
        # failure: dump the stacks of ranks still running, then kill every rank
        timed_out = grace_end is None or time.monotonic() >= end
        stuck = list(pending.values())
        for i in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(workers[i].pid, signal.SIGUSR1)
        if stuck:
            time.sleep(0.5)
        for i in stuck:
            reason = (f"still running at the deadline ({deadline:g} s)" if timed_out
                      else f"still running {GRACE:g} s after another rank failed")
            replies[i] = _Reply("hung", text=reason)
        report = [f"{what} failed in {self} after {time.monotonic() - start:.1f} s:"]
        for i, w in enumerate(workers):
            r = replies[i]
            label = f"rank {i} (pid {w.pid})"
            if r.status == "ok":
                report.append(f"--- {label}: ok")
                continue
            report.append(f"--- {label}: {r.status}: {r.value or r.text}")
            if r.status == "error":
                report.append(r.text.rstrip())
            log = w.log_since(offsets[i]).rstrip()
            if log:
                report.append(f"    output of rank {i} (stack dump if it was hung):")
                report.append(log)
        self._workers.kill(workers)
        for w in workers:
            w.pool = None
        raise RankFailure("\n".join(report))

    # -- lifetime

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._own_workers:
            self._workers.shutdown()
            shutil.rmtree(self._workers.logdir, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        return self._workers.pids()


def _short_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [_short(a) for a in args] + [f"{k}={_short(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class PoolSet:
    """Pools keyed by configuration, all on one set of reused rank processes, and one
    TCPStore for their rendezvous. Close it at the end of the session."""

    def __init__(self) -> None:
        self.logdir = tempfile.mkdtemp(prefix="plait-harness-")
        self.workers = _Workers(self.logdir)
        self._store: Any = None
        self._pools: dict[tuple[Any, ...], Pool] = {}

    def get(self, size: int, transport: str = "shm", *, env: Mapping[str, str] | None = None,
            hosts: Sequence[str] | None = None, timeout: float | None = DEFAULT_TIMEOUT,
            init: str = "store") -> Pool:
        key = (size, transport, tuple(sorted((env or {}).items())),
               tuple(hosts) if hosts is not None else None, timeout, init)
        pool = self._pools.get(key)
        if pool is None:
            if self._store is None and init == "store":
                import torch.distributed as dist

                self._store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                            wait_for_workers=False,
                                            timeout=_timedelta(INIT_DEADLINE))
            extra = "".join(f",{k}={v}" for k, v in sorted((env or {}).items()))
            name = f"{transport}-{size}{extra}" + (f",timeout={timeout:g}"
                                                   if timeout != DEFAULT_TIMEOUT and timeout
                                                   else "")
            pool = Pool(size, transport, env=env, hosts=hosts, init=init, timeout=timeout,
                        workers=self.workers, store=self._store, name=name)
            self._pools[key] = pool
        return pool

    def fresh(self, size: int, transport: str = "shm", **kwargs: Any) -> Pool:
        """A pool on new processes of its own (close it when done)."""
        return Pool(size, transport, **kwargs)

    @property
    def processes_started(self) -> int:
        return self.workers.started

    def close(self) -> None:
        self.workers.shutdown()
        self._pools.clear()
        self._store = None
        shutil.rmtree(self.logdir, ignore_errors=True)
