"""Hierarchical collectives (algorithms/hier.py) on real rank processes, with fake hosts
(``PLAIT_HOST_ID``): shared memory inside a host, TCP between hosts, on this machine.

Every operation that has a ``hier`` algorithm, forced through ``PLAIT_ALGO``, against the
reference: 2 hosts x 2 ranks (block placement), 2 x 3 with ranks dealt round-robin over
the hosts (the host/local-rank mapping is not the rank order), counts 0, 1, odd, and
larger than the shrunk slot/chunk, with uneven allreduce parts; and the fallback to flat
algorithms on hosts with unequal rank counts. Multi-stream TCP (several sockets per peer,
frames of one message on any socket) runs underneath: the pools' TCP frames are 4 KiB.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.harness import BIG_COUNT
from test_collectives import case_ops

HIER_ALL = "allreduce:hier;broadcast:hier;allgather:hier;reduce_scatter:hier;alltoall:hier"
HIER_OPS = ["allreduce", "broadcast", "allgather", "allgatherv", "reduce_scatter",
            "alltoall", "alltoallv"]
CASES = [(0, "float32", "numpy"), (1, "int64", "numpy"), (7, "bfloat16", "torch"),
         (BIG_COUNT, "float32", "torch"), (BIG_COUNT * 3 + 1, "int32", "numpy")]


def case_hier(comm: Any, cases: list[tuple[int, str, str]]) -> dict[str, Any]:
    for count, dtype, lib in cases:
        case_ops(comm, HIER_OPS, count, dtype, lib)
    from plait.tuning import selector

    d = selector.choose("allreduce", 1 << 20, comm._situation, comm._cfg.algo)
    return {"algo": d.algo, "local": comm._hier.L if comm._hier else None,
            "transports": [comm.peer_transport(r) for r in range(comm.size)]}


@pytest.mark.parametrize(("hosts", "nsocks"), [
    (["A", "A", "B", "B"], "1"),
    (["A", "A", "B", "B"], "4"),
    (["A", "B", "A", "B", "A", "B"], "2"),
])
def test_hier_every_op(pools: Any, hosts: list[str], nsocks: str) -> None:
    pool = pools.get(len(hosts), "shm", hosts=hosts,
                     env={"PLAIT_ALGO": HIER_ALL, "PLAIT_NSOCKS": nsocks})
    out = pool.run(case_hier, CASES)
    for r, o in enumerate(out):
        assert o["algo"] == "hier"
        assert o["local"] == len(hosts) // 2
        assert o["transports"] == ["shm" if hosts[p] == hosts[r] else "tcp"
                                   for p in range(len(hosts))]


def case_default_choice(comm: Any) -> list[str]:
    from plait.tuning import selector

    case_ops(comm, ["allreduce", "alltoall", "allgather"], BIG_COUNT, "float32", "numpy")
    return [selector.choose(op, 16 << 20, comm._situation).algo
            for op in ("allreduce", "alltoall")]


def test_uneven_hosts_fall_back_to_flat(pools: Any) -> None:
    """Hosts with 2 and 1 ranks: hier cannot run; the defaults pick flat algorithms."""
    out = pools.get(3, "shm", hosts=["A", "A", "B"]).run(case_default_choice)
    assert all(o == ["ring", "pairwise"] for o in out), out


def case_p2p_in_order(comm: Any, sizes: list[int]) -> int:
    """Messages with one tag, some striped over several sockets: received in send order."""
    import numpy as np

    if comm.rank == 0:
        for i, n in enumerate(sizes):
            comm.send(np.full(n, i, dtype=np.int32), 1, tag=3)
    else:
        for i, n in enumerate(sizes):
            buf = np.empty(n, dtype=np.int32)
            comm.recv(buf, 0, tag=3)
            assert (buf == i).all(), f"message {i} of {n} elements arrived out of order"
    return comm.peer_transport(1 - comm.rank) == "tcp"


def test_p2p_order_over_several_sockets(pools: Any) -> None:
    sizes = [5000, 1, 20000, 3, 9000, 0, 40000, 2] * 3  # 4 KiB frames: most are striped
    out = pools.get(2, "shm", hosts=["A", "B"], env={"PLAIT_NSOCKS": "4"}).run(
        case_p2p_in_order, sizes)
    assert out == [True, True]


def test_engine_opens_messages_in_sequence_order() -> None:
    """A later message's frame arriving first must not take an earlier message's receive."""
    import numpy as np

    from plait.comm import Work
    from plait.p2p import Engine, Recv
    from plait.transport import wire

    eng = Engine(0)
    bufs = [np.zeros(8, dtype=np.uint8) for _ in range(2)]
    works = [Work() for _ in range(2)]
    for b, w in zip(bufs, works, strict=True):
        eng.post(Recv(b, 1, 7, w, "test"))

    def frame(seq: int, off: int, n: int, fill: int) -> None:
        f = wire.Frame(wire.KIND_P2P, 7, seq, off, n, 8)
        eng.on_frame(1, f, lambda dst: dst.__setitem__(slice(None), fill))

    frame(1, 4, 4, 21)  # message 1, second half, first to arrive
    frame(0, 0, 4, 10)
    frame(1, 0, 4, 20)
    # message 1 is complete, and went to the second receive although it started first
    assert not works[0].is_completed() and works[1].is_completed()
    frame(0, 4, 4, 11)
    assert works[0].is_completed() and works[1].is_completed()
    assert list(bufs[0]) == [10] * 4 + [11] * 4
    assert list(bufs[1]) == [20] * 4 + [21] * 4
