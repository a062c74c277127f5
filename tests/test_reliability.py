"""Failures are clear errors on every rank, bad input is refused, nothing leaks, only the
job's ranks can connect (docs/RELIABILITY.md maps each guarantee to a test here)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest

from plait.testing import reference as ref
from plait.testing.data import assert_equal, empty, make, values
from plait.testing.harness import BIG_COUNT
from plait.testing.leaks import leaks as _leaks
from plait.testing.leaks import resources as _resources

# ----------------------------------------------------------------------------- helpers


def _stream(comm: Any, i: int) -> None:
    """Operation ``i`` of a verified stream of mixed collectives."""
    n, me = comm.size, comm.rank
    count = (17, 300, BIG_COUNT)[i % 3]
    kind = i % 3
    if kind == 0:
        b = make("float32", count, me, op="sum", seed=i)
        comm.allreduce(b)
        assert_equal(b, ref.allreduce([values("float32", count, r, op="sum", seed=i)
                                       for r in range(n)], "sum")[me], f"allreduce {i}")
    elif kind == 1:
        root = i % n
        b = make("int32", count, me, seed=i)
        comm.broadcast(b, root)
        assert_equal(b, values("int32", count, root, seed=i), f"broadcast {i}")
    else:
        out = empty("int64", count * n)
        comm.allgather(make("int64", count, me, seed=i), out)
        assert_equal(out, np.concatenate([values("int64", count, r, seed=i)
                                          for r in range(n)]), f"allgather {i}")


# ------------------------------------------------------------- peer failure, everywhere


def case_sigkill_in_stream(comm: Any, victim: int, at: int, ring_only: bool) -> dict[str, Any]:
    """A stream of verified collectives on a child communicator; ``victim`` SIGKILLs itself
    at operation ``at``. Every survivor must raise PeerFailedError naming it within 10 s,
    and leave nothing behind once it closes the child."""
    import plait

    before = _resources(comm)
    child = comm.split(0)
    uid = child._uid.hex()[:20]
    last_ok = time.monotonic()
    try:
        for i in range(10_000):
            if comm.rank == victim and i == at:
                os.kill(os.getpid(), signal.SIGKILL)
            if ring_only:
                b = make("float32", 300, child.rank, op="sum", seed=i)
                child.allreduce(b)
            else:
                _stream(child, i)
            last_ok = time.monotonic()
    except plait.PlaitError as exc:
        elapsed = time.monotonic() - last_ok
        result = {"type": type(exc).__name__, "peer": getattr(exc, "peer", None),
                  "elapsed": elapsed, "msg": str(exc)}
    else:
        raise AssertionError(f"rank {comm.rank}: the stream survived the loss of rank {victim}")
    child.close()
    result["leaks"] = _leaks(before, uid)
    return result


def _check_survivors(results: list[Any], victim: int) -> None:
    for r, res in enumerate(results):
        if r == victim:
            assert res is None
            continue
        assert res["type"] == "PeerFailedError", f"rank {r}: {res}"
        assert res["peer"] == victim, f"rank {r} blames rank {res['peer']}: {res['msg']}"
        assert f"rank {victim}" in res["msg"], res
        assert res["elapsed"] < 10, f"rank {r}: {res['elapsed']:.1f} s: {res['msg']}"
        assert not res["leaks"], f"rank {r}: {res['leaks']}"


def test_sigkill_shm_every_rank_raises(pools: Any) -> None:
    pool = pools.get(4, "shm")
    results = pool.run(case_sigkill_in_stream, 0, 40, False, may_die=[0])  # the creator
    _check_survivors(results, 0)


def test_sigkill_tcp_reaches_ranks_without_a_connection(pools: Any) -> None:
    """Four hosts, ring allreduce only: rank r receives only from r-1 and sends only to
    r+1, so rank 3 has no connection to rank 1 and learns of its death from the others'
    abort notice."""
    hosts = ["h0", "h1", "h2", "h3"]
    pool = pools.get(4, "shm", hosts=hosts, env={"PLAIT_ALGO": "allreduce:ring"})
    results = pool.run(case_sigkill_in_stream, 1, 30, True, may_die=[1])
    _check_survivors(results, 1)
    assert "reported by rank" in results[3]["msg"], results[3]


def test_sigkill_mixed_hosts(pools: Any) -> None:
    pool = pools.get(4, "mixed")
    results = pool.run(case_sigkill_in_stream, 3, 25, False, may_die=[3])
    _check_survivors(results, 3)


# ------------------------------------------------------------------------- abort


def case_abort(comm: Any, aborter: int) -> dict[str, Any]:
    """``aborter`` aborts (from a second thread, while its main thread waits in a receive)
    while the others wait in an allreduce it never joins: every pending operation on every
    rank fails."""
    import plait

    before = _resources(comm)
    child = comm.split(0)
    uid = child._uid.hex()[:20]
    child.allreduce(make("float32", 10, child.rank))
    t0 = time.monotonic()
    if comm.rank == aborter:
        timer = threading.Timer(0.5, child.abort)
        timer.start()
        pending = child.irecv(empty("int32", 4), (aborter + 1) % comm.size, tag=3)
        with pytest.raises(plait.ClosedError, match="aborted"):
            child.recv(empty("int32", 4), (aborter + 2) % comm.size, tag=4)  # never sent
        with pytest.raises(plait.ClosedError):
            pending.wait(10)
        with pytest.raises(plait.ClosedError):
            child.allreduce(make("float32", 3, child.rank))
        timer.join()
        res = {"type": "ClosedError", "elapsed": time.monotonic() - t0, "msg": ""}
    else:
        with pytest.raises(plait.PeerFailedError) as info:
            child.allreduce(make("float32", BIG_COUNT, child.rank))
        res = {"type": "PeerFailedError", "elapsed": time.monotonic() - t0,
               "msg": str(info.value), "peer": info.value.peer}
    child.close()
    res["leaks"] = _leaks(before, uid)
    comm.barrier()  # the parent is unaffected
    return res


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_abort_unblocks_every_rank(pools: Any, transport: str) -> None:
    results = pools.get(3, transport).run(case_abort, 1)
    for r, res in enumerate(results):
        assert res["elapsed"] < 5, (r, res)
        assert not res["leaks"], (r, res["leaks"])
        if r != 1:
            assert res["peer"] == 1 and "rank 1 aborted" in res["msg"], res


# -------------------------------------------------------------- timeout diagnostics


def _noop(comm: Any) -> None:
    pass


def case_missing_rank_report(comm: Any, absent: int, ops: int, dump_dir: str) -> dict[str, Any]:
    """Every rank runs ``ops`` allreduces; ``absent`` skips the last one."""
    import plait

    for i in range(ops - 1):
        comm.allreduce(make("int32", 5, comm.rank, op="sum", seed=i))
    if comm.rank == absent:
        time.sleep(0.5)
        return {}
    with pytest.raises(plait.CommTimeoutError) as info:
        comm.allreduce(make("int32", BIG_COUNT, comm.rank))
    record = comm.flight_record()
    files = [f for f in os.listdir(dump_dir) if f"-r{comm.rank}-{os.getpid()}" in f]
    dumped = None
    if files:
        with open(os.path.join(dump_dir, files[0])) as f:
            dumped = json.load(f)
    return {"msg": str(info.value), "record": record, "dumped": dumped}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_timeout_says_where_every_rank_is(pools: Any, transport: str, tmp_path: Any,
                                         capsys: Any) -> None:
    d = str(tmp_path)
    pools.get(4, transport).run(_noop)  # four live rank processes: init within the timeout
    pool = pools.get(4, transport, timeout=2.5, env={"PLAIT_FLIGHT_RECORDER_DIR": d})
    pool.reset()  # fresh communicators: sequence numbers start at 1
    results = pool.run(case_missing_rank_report, 2, 4, d, reset_after=True)
    for r in (0, 1, 3):
        msg = results[r]["msg"]
        assert "ranks 0, 1, 3 are in allreduce #4" in msg, msg
        if transport == "shm":
            assert "rank 2 is idle after allreduce #3" in msg, msg
        else:
            assert re.search(r"rank 2 has not reported", msg), msg
        rec = results[r]["record"]
        assert [e["seq"] for e in rec] == [1, 2, 3, 4], rec
        assert [e["state"] for e in rec] == ["done"] * 3 + ["failed"], rec
        assert rec[0]["op"] == "allreduce" and rec[0]["dtype"] == "int32" and rec[0]["bytes"] == 20
        assert rec[3]["bytes"] == 4 * BIG_COUNT and rec[3]["algorithm"]
        assert rec[0]["duration_us"] is not None and rec[0]["duration_us"] >= 0
        dumped = results[r]["dumped"]
        assert dumped is not None and "Timed out" in dumped["reason"], dumped
        assert dumped["records"][-1]["seq"] == 4
    from plait.cli.main import main

    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".json"))
    assert len(files) == 3, files
    assert main(["flightrec", *files]) == 0
    out = capsys.readouterr().out
    assert out.count("#4 ") == 3 and "Timed out" in out, out


# torch's own convention for timeout errors: torch/testing/_internal/distributed/
# distributed_test.py asserts " (Timed out|closed|timeout) " (_test_barrier_timeout) and
# "Timed out waiting 1ms" (test_barrier_timeout_arg, gloo's wording)
TORCH_TIMEOUT_RE = " (Timed out|closed|timeout) "


def case_barrier_alone(comm: Any) -> dict[str, Any]:
    """Only rank 0 enters the barrier: it must time out in torch's wording."""
    import plait

    if comm.rank != 0:
        return {}
    t0 = time.monotonic()
    with pytest.raises(plait.CommTimeoutError) as info:
        comm.barrier()
    return {"msg": str(info.value), "elapsed": time.monotonic() - t0}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_barrier_timeout_matches_torch_convention(pools: Any, transport: str) -> None:
    pool = pools.get(3, transport, timeout=1.0)
    pool.reset()  # fresh communicators: the barrier is #1
    res = pool.run(case_barrier_alone, reset_after=True)[0]
    msg = res["msg"]
    assert re.search(TORCH_TIMEOUT_RE, msg), msg
    assert re.search(r"Timed out waiting 1000ms", msg), msg
    # plait's detail is kept: rank, operation, sequence number, who it waited for
    assert msg.startswith("rank 0, barrier #1: Timed out waiting 1000ms for "), msg
    assert "ranks 1, 2" in msg, msg
    assert 0.9 <= res["elapsed"] < 10, res


def test_other_timeouts_match_torch_convention() -> None:
    """Work.wait (its own timeout and the communicator's) and rendezvous store waits."""
    import torch.distributed as dist

    import plait
    from plait.rendezvous import wait_key
    from plait.work import Work

    msgs = []
    for work, t in ((Work(), 0.05), (Work(0.05, "rank 0, recv from rank 1 with tag 3"), None)):
        with pytest.raises(plait.CommTimeoutError) as info:
            work.wait(t)
        msgs.append(str(info.value))
    with pytest.raises(plait.CommTimeoutError) as info:
        wait_key(dist.HashStore(), "plait/0/job", 0.05)
    msgs.append(str(info.value))
    for msg in msgs:
        assert re.search(TORCH_TIMEOUT_RE, msg) and "Timed out waiting 50ms" in msg, msgs
    assert msgs[1].startswith("rank 0, recv from rank 1 with tag 3: Timed out"), msgs
    assert "'plait/0/job'" in msgs[2], msgs


def test_flight_recorder_unit() -> None:
    from plait.flightrec import ENDED, ERROR, STARTED, FlightRecorder, format_records

    rec = FlightRecorder(20)
    assert rec.size == 32
    for seq in range(1, 41):
        rec.slots[seq & rec.mask] = [seq, "allreduce", 8 * seq, None, "direct",
                                     time.monotonic(), 0.0, 0.0, None]
        if seq < 39:
            rec.slots[seq & rec.mask][STARTED] = time.monotonic()
            rec.slots[seq & rec.mask][ENDED] = time.monotonic()
    rec.slots[38 & rec.mask][ERROR] = "PeerFailedError: x"
    rows = rec.records()
    assert [r["seq"] for r in rows] == list(range(9, 41))  # the newest 32
    assert [r["state"] for r in rows[-3:]] == ["failed", "queued", "queued"]
    assert rec.op_name(40) == "allreduce" and rec.op_name(1) == "op"
    assert "#40" in format_records(rows)


def test_flight_recorder_costs_well_under_a_microsecond() -> None:
    """The hot-path statements of _submit/_execute, timed alone."""
    import timeit

    from plait.flightrec import ENDED, STARTED, FlightRecorder

    rec = FlightRecorder(1024)
    ctl = memoryview(np.zeros(64, dtype=np.int64))
    state = {"seq": 0}

    def hot() -> None:
        state["seq"] += 1
        seq = state["seq"]
        slot = [seq, "allreduce", 64, None, "direct", 0.0, 0.0, 0.0, None]
        rec.slots[seq & rec.mask] = slot
        slot = rec.slots[seq & rec.mask]
        slot[STARTED] = 1.0  # the start stamp is the deadline's, taken anyway
        slot[ENDED] = time.monotonic()
        ctl[9] = seq

    def empty_fn() -> None:
        state["seq"] += 1

    n = 20000
    cost = min(timeit.repeat(hot, number=n, repeat=5)) / n
    base = min(timeit.repeat(empty_fn, number=n, repeat=5)) / n
    assert cost - base < 1e-6, f"{(cost - base) * 1e6:.2f} us per operation"


# ------------------------------------------------------------------------ bad input


def case_bad_input(comm: Any) -> list[str]:
    """Each row of docs/RELIABILITY.md's table: the specific error, raised on this rank
    alone before any communication; the communicator stays usable (every rank runs the
    same rows, then a verified allreduce)."""
    import torch

    import plait

    n, me = comm.size, comm.rank
    f32 = lambda k: make("float32", k, me)  # noqa: E731
    rows: list[tuple[str, Any, str, Any]] = [
        ("unsupported dtype", TypeError, "unsupported dtype",
         lambda: comm.allreduce(np.zeros(3, dtype=np.complex64))),
        ("send/recv dtypes differ", TypeError, "differ in dtype",
         lambda: comm.allgather(f32(3), make("float64", 3 * n, me))),
        ("recvbuf too small", ValueError, "must have exactly",
         lambda: comm.allgather(f32(3), f32(3 * n - 1))),
        ("alltoallv counts do not add up", ValueError, "sum of send_counts",
         lambda: comm.alltoallv(f32(n + 1), [1] * n, f32(n), [1] * n)),
        ("alltoallv negative count", ValueError, "negative",
         lambda: comm.alltoallv(f32(n), [2] + [1] * (n - 2) + [-1], f32(n), [1] * n)),
        ("invalid root", ValueError, "is not a rank",
         lambda: comm.broadcast(f32(3), n)),
        ("invalid peer", ValueError, "is not a rank",
         lambda: comm.send(f32(3), n + 1)),
        ("invalid tag", ValueError, "tag",
         lambda: comm.send(f32(3), 0, tag=-1)),
        ("unsupported reduce op for the dtype", TypeError, "",
         lambda: comm.allreduce(f32(3), op="band")),
        ("unknown reduce op", ValueError, "",
         lambda: comm.allreduce(f32(3), op="mean")),
        ("meta tensor", ValueError, "device meta",
         lambda: comm.allreduce(torch.empty(4, device="meta"))),
        ("non-contiguous tensor", ValueError, "not contiguous",
         lambda: comm.allreduce(torch.arange(12.0).reshape(3, 4).t())),
        ("non-contiguous array", ValueError, "not contiguous",
         lambda: comm.allreduce(np.arange(20, dtype=np.float32)[::2])),
        ("read-only receive buffer", ValueError, "read-only",
         lambda: comm.allreduce(np.frombuffer(b"\0" * 16, dtype=np.float32))),
        ("not a buffer", TypeError, "numpy array or a torch CPU tensor",
         lambda: comm.allreduce([1.0, 2.0])),
    ]
    seen = []
    for what, exc_type, fragment, call in rows:
        with pytest.raises(exc_type) as info:
            call()
        msg = str(info.value)
        assert f"rank {me}" in msg and fragment in msg, f"{what}: {msg!r}"
        seen.append(what)
    # use after close: a child communicator
    child = comm.split(0)
    child.close()
    with pytest.raises(plait.ClosedError, match=f"rank {child.rank}"):
        child.allreduce(f32(3))
    seen.append("use after close")
    b = make("float32", BIG_COUNT, me, op="sum")
    comm.allreduce(b)
    assert_equal(b, ref.allreduce([values("float32", BIG_COUNT, r, op="sum")
                                   for r in range(n)], "sum")[me], "after bad input")
    return seen


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bad_input_table(pools: Any, transport: str) -> None:
    seen = pools.get(3, transport).run(case_bad_input)[0]
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "RELIABILITY.md")) as f:
        doc = f.read()
    for row in seen:
        assert f"| {row} |" in doc, f"docs/RELIABILITY.md has no row {row!r}"


def case_debug_check(comm: Any) -> list[str]:
    """PLAIT_DEBUG=check: mismatched lengths or ops raise MismatchError on every rank,
    invalid arguments on one rank raise there and name it everywhere else; the
    communicator stays usable after each."""
    import plait

    n, me = comm.size, comm.rank
    msgs = []
    with pytest.raises(plait.MismatchError) as info:  # mismatched lengths
        comm.allreduce(make("float32", 5 if me == 0 else 6, me))
    msg = str(info.value)
    assert "rank 0: allreduce dtype=float32 count=5" in msg, msg
    assert f"rank {n - 1}: allreduce dtype=float32 count=6" in msg, msg
    msgs.append(msg)
    with pytest.raises(plait.MismatchError) as info:  # different roots
        comm.broadcast(make("int32", 4, me), me % 2)
    assert "root=0" in str(info.value) and "root=1" in str(info.value)
    with pytest.raises(plait.MismatchError) as info:  # different operations
        if me == 1:
            comm.barrier()
        else:
            comm.allreduce(make("float32", 5, me))
    assert "barrier" in str(info.value)
    if me == 0:  # invalid arguments on one rank: it raises its own error ...
        with pytest.raises(ValueError):
            comm.broadcast(make("int32", 4, me), n)
    else:  # ... and the others learn which rank it was, instead of hanging
        with pytest.raises(plait.MismatchError, match="rank 0: broadcast with invalid"):
            comm.broadcast(make("int32", 4, me), 0)
    b = make("float32", 300, me, op="sum")
    comm.allreduce(b)
    assert_equal(b, ref.allreduce([values("float32", 300, r, op="sum")
                                   for r in range(n)], "sum")[me], "usable after mismatch")
    return msgs


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_debug_check_mismatched_lengths(pools: Any, transport: str) -> None:
    pools.get(3, transport, env={"PLAIT_DEBUG": "check"}).run(case_debug_check)


# ----------------------------------------------------------------------------- leaks


def case_leaks_after_close_and_error(comm: Any) -> list[str]:
    """Resources of a child communicator after close, and after a failed operation."""
    import plait

    before = _resources(comm)
    child = comm.split(0)
    uid = child._uid.hex()[:20]
    _stream(child, 0)
    _stream(child, 2)
    if child.size > 1:
        child.send(make("int8", 10, 0), (child.rank + 1) % child.size, tag=1)
        child.recv(empty("int8", 10), (child.rank - 1) % child.size, tag=1)
    child.close()
    problems = _leaks(before, uid)
    # after an exception: a mismatch (sizes) breaks the child; then close
    child = comm.split(0)
    uid = child._uid.hex()[:20]
    try:
        child.allreduce(make("float32", 100 if child.rank == 0 else 2000, child.rank))
    except plait.PlaitError:
        pass
    child.close()
    return problems + _leaks(before, uid)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_nothing_leaks_after_close_or_error(pools: Any, transport: str) -> None:
    pool = pools.get(3, transport, timeout=3.0)
    results = pool.run(case_leaks_after_close_and_error, reset_after=True)
    assert results == [[], [], []], results


# ----------------------------------------------------------------------------- security


def case_bind_address(comm: Any) -> str:
    return str(comm.describe()["listen"])


@pytest.mark.parametrize("env", [{}, {"PLAIT_SOCKET_IFNAME": "lo"}])
def test_listener_binds_to_the_rendezvous_route_or_interface(pools: Any, env: dict[str, str]
                                                             ) -> None:
    addrs = pools.get(2, "tcp", env=env).run(case_bind_address)
    assert addrs == ["127.0.0.1", "127.0.0.1"], addrs


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _attacks(comm: Any, addr: tuple[str, int], target: int) -> list[str]:
    """Foreign clients against ``target``'s listener; what each saw."""
    from plait.transport import wire

    outcomes = []

    def client(payload: bytes, read: int = 0) -> str:
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(payload)
            if read:
                got = b""
                while len(got) < read:
                    chunk = s.recv(read - len(got))
                    if not chunk:
                        break
                    got += chunk
                if len(got) == read:
                    s.sendall(struct.pack("<HBBIQQIIQ", 0x4C50, 1, 1, 0, 0, 0, 0xFFFFFFFF,
                                          0, 1 << 41))
            s.settimeout(10)
            try:
                rest = s.recv(100)
            except OSError as exc:
                return f"closed ({type(exc).__name__})"
            return "closed" if rest == b"" else f"answered {rest!r}"

    outcomes.append(client(os.urandom(200)))  # garbage
    outcomes.append(client(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 60))
    ids = comm.describe()["identity"]
    job, uid = bytes.fromhex(ids["job"]), bytes.fromhex(ids["communicator"])
    wrong_job = wire.Hello(wire.VERSION, 0, os.urandom(16), uid, 0, target,
                           os.urandom(16)).pack()
    outcomes.append(client(wrong_job))
    # the right job and communicator (a party that read the store) but not the secret:
    # the challenge comes back; the "response" is an oversized frame header instead
    right_ids = wire.Hello(wire.VERSION, 0, job, uid, 0, target,
                           os.urandom(16)).pack()
    outcomes.append(client(right_ids, read=wire.CHALLENGE_SIZE))
    return outcomes


def case_foreign_clients(comm: Any) -> dict[str, Any]:
    """While the ranks run verified collectives, rank 0 throws foreign clients at rank 1's
    listener. They are dropped and logged; the job carries on undisturbed."""
    cap = _Capture()
    logging.getLogger("plait").addHandler(cap)
    try:
        # every rank's listening port, so rank 0 can reach rank 1's listener
        ports = np.zeros(comm.size, dtype=np.int64)
        mine = np.array([comm.describe()["port"]], dtype=np.int64)
        comm.allgather(mine, ports)
        outcomes: list[str] = []
        thread = None
        if comm.rank == 0:
            host, port = comm.describe()["listen"], int(ports[1])
            def attack() -> None:
                try:
                    outcomes.extend(_attacks(comm, (host, int(port)), 1))
                except Exception as exc:  # reported through the outcomes
                    outcomes.append(f"attack failed: {exc!r}")

            thread = threading.Thread(target=attack)
            thread.start()
        for i in range(150):
            _stream(comm, i)
        if thread is not None:
            thread.join(30)
        comm.barrier()
        time.sleep(0.2)
        return {"outcomes": outcomes, "warnings": list(cap.messages)}
    finally:
        logging.getLogger("plait").removeHandler(cap)


def test_foreign_clients_are_dropped_and_logged(pools: Any) -> None:
    results = pools.get(3, "tcp").run(case_foreign_clients)
    outcomes = results[0]["outcomes"]
    assert len(outcomes) == 4 and all(o.startswith("closed") for o in outcomes), outcomes
    dropped = [m for m in results[1]["warnings"] if "dropped connection" in m]
    assert len(dropped) == 4, results[1]["warnings"]
    assert any("another job" in m for m in dropped), dropped
    assert any("authentication" in m or "response" in m for m in dropped), dropped


def test_shm_segment_is_owner_only() -> None:
    from plait.transport import shm

    name = f"plait-test-mode-{os.getpid()}"
    old = os.umask(0)  # even with a permissive umask
    try:
        seg = shm.create(name, shm.Layout(2, 1024, 4096, 2), 0)
    finally:
        os.umask(old)
    try:
        mode = os.stat(shm.shm_path(name)).st_mode & 0o777
        assert mode == 0o600, oct(mode)
    finally:
        shm.unlink(name)
        seg.close()


# -------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=80), st.integers(0, 1 << 24))
def test_fuzz_parse_header_random_bytes(data: bytes, max_len: int) -> None:
    from plait.errors import TransportError
    from plait.transport import wire

    try:
        f = wire.parse_header(data, max_len)
    except TransportError:
        return
    assert f.length <= max_len and f.offset + f.length <= f.total <= wire.MAX_TOTAL


@settings(max_examples=600, deadline=None)
@given(kind=st.integers(0, 255), tag=st.integers(0, 2**32 - 1), seq=st.integers(0, 2**64 - 1),
       offset=st.integers(0, 2**64 - 1), length=st.integers(0, 2**32 - 1),
       flags=st.sampled_from([0, 0, 1, 2**31]), total=st.integers(0, 2**64 - 1),
       version=st.sampled_from([1, 1, 0, 2]))
def test_fuzz_parse_header_fields(kind: int, tag: int, seq: int, offset: int, length: int,
                                  flags: int, total: int, version: int) -> None:
    """Headers with the right magic and arbitrary fields: any Frame accepted is bounded."""
    from plait.errors import TransportError
    from plait.transport import wire

    raw = wire.HEADER.pack(wire.FRAME_MAGIC, version, kind, tag, seq, offset, length, flags,
                           total)
    try:
        f = wire.parse_header(raw, 1 << 20)
    except TransportError:
        return
    assert f.kind in (wire.KIND_COLL, wire.KIND_P2P, wire.KIND_BYE)
    assert f.length <= 1 << 20 and f.offset + f.length <= f.total <= wire.MAX_TOTAL


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=120), st.binary(min_size=0, max_size=64))
def test_fuzz_handshake_parsers(data: bytes, secret: bytes) -> None:
    from plait.errors import TransportError
    from plait.transport import wire

    hello = wire.Hello(1, 0, b"j" * 16, b"c" * 16, 0, 1, b"n" * 16).pack()
    for parse in (lambda: wire.Hello.unpack(data),
                  lambda: wire.check_challenge(secret, hello, data),
                  lambda: wire.check_response(secret, hello, b"x" * 16, data)):
        try:
            parse()
        except TransportError:
            pass
