"""Point-to-point: tags, any-source receives, per-(pair, tag) ordering, receives posted
before sends, lazy connections right after init, and messages larger than a chunk; on
shm, TCP and the mixed pool."""

from __future__ import annotations

import time
from typing import Any

import pytest

from plait.testing.data import assert_equal, empty, make, values
from plait.testing.harness import BIG_COUNT

TRANSPORTS = ("shm", "tcp", "mixed")
HUGE = 50_000  # float32: 200 KB, many chunks and several laps of a 4 x 4 KiB ring


def case_tags_out_of_order(comm: Any, count: int) -> None:
    """Rank 0 sends tags 5, 3, 9 to the last rank, which receives them as 9, 3, 5."""
    last = comm.size - 1
    tags = (5, 3, 9)
    if comm.rank == 0:
        works = [comm.isend(make("float32", count, 0, seed=t), last, tag=t) for t in tags]
        for w in works:
            assert w.wait() is True
    elif comm.rank == last:
        for t in reversed(tags):
            buf = empty("float32", count)
            assert comm.recv(buf, 0, tag=t) == 0
            assert_equal(buf, values("float32", count, 0, seed=t), f"tag {t}")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("count", [0, 1, BIG_COUNT])
def test_tags_match_independently(pools: Any, transport: str, count: int) -> None:
    pools.get(3, transport).run(case_tags_out_of_order, count)


def case_any_source(comm: Any, count: int) -> None:
    """Every rank but 0 sends twice to rank 0 with tag 7; rank 0 receives with src=None
    and must learn each message's source (sync recv and irecv's Work.source)."""
    if comm.rank == 0:
        seen = []
        for i in range(2 * (comm.size - 1)):
            buf = empty("int32", count + 1)
            if i % 2:
                work = comm.irecv(buf, None, tag=7)
                work.wait()
                src = work.source
            else:
                src = comm.recv(buf, tag=7)
            assert isinstance(src, int) and 0 < src < comm.size, src
            nth = seen.count(src)
            assert_equal(buf, values("int32", count + 1, src, seed=nth), f"from {src} #{nth}")
            seen.append(src)
        assert sorted(seen) == sorted(list(range(1, comm.size)) * 2)
    else:
        for nth in range(2):
            comm.send(make("int32", count + 1, comm.rank, seed=nth), 0, tag=7)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 5])
def test_any_source(pools: Any, transport: str, world: int) -> None:
    pool = pools.get(world, transport)
    for count in (0, 7, BIG_COUNT):
        pool.run(case_any_source, count)


def case_ordering(comm: Any, n: int, count: int) -> None:
    """n messages between one pair on one tag arrive in send order, also when sizes vary
    (small ones may take a faster path than big ones)."""
    if comm.rank == 1:
        works = [comm.isend(make("int64", count * (i % 3), 1, seed=i), 0, tag=4)
                 for i in range(n)]
        for w in works:
            w.wait()
    elif comm.rank == 0:
        for i in range(n):
            buf = empty("int64", count * (i % 3))
            comm.recv(buf, 1, tag=4)
            assert_equal(buf, values("int64", count * (i % 3), 1, seed=i), f"message {i}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_per_pair_tag_ordering(pools: Any, transport: str) -> None:
    pool = pools.get(2, transport)
    pool.run(case_ordering, 40, 5)
    pool.run(case_ordering, 6, BIG_COUNT)


def case_recv_posted_first(comm: Any) -> None:
    """Rank 0 posts irecvs for tags 1 and 2 long before rank 1 sends; rank 1 sends tag 2
    first, and a pending receive of tag 1 must not block it."""
    if comm.rank == 0:
        b1, b2 = empty("float64", BIG_COUNT), empty("float64", 3)
        w1 = comm.irecv(b1, 1, tag=1)
        w2 = comm.irecv(b2, 1, tag=2)
        assert not w1.is_completed() and not w2.is_completed()
        assert w2.wait() is True and w2.source == 1
        assert_equal(b2, values("float64", 3, 1, seed=2), "tag 2")
        comm.send(make("int8", 1, 0), 1, tag=99)  # now rank 1 may send tag 1
        assert w1.wait() is True and w1.source == 1
        assert_equal(b1, values("float64", BIG_COUNT, 1, seed=1), "tag 1")
    elif comm.rank == 1:
        time.sleep(0.2)
        comm.send(make("float64", 3, 1, seed=2), 0, tag=2)
        comm.recv(empty("int8", 1), 0, tag=99)
        comm.send(make("float64", BIG_COUNT, 1, seed=1), 0, tag=1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receive_posted_before_send(pools: Any, transport: str) -> None:
    pools.get(3, transport).run(case_recv_posted_first)


def case_first_op_is_p2p(comm: Any, a: int, b: int, count: int) -> None:
    """Right after init, ranks a and b exchange messages; the others do nothing (lazy,
    per-pair connections)."""
    if comm.rank not in (a, b):
        return
    peer = b if comm.rank == a else a
    out = make("float32", count, comm.rank)
    buf = empty("float32", count)
    if comm.rank == a:
        comm.send(out, peer, tag=11)
        assert comm.recv(buf, peer, tag=12) == peer
    else:
        assert comm.recv(buf, peer, tag=11) == peer
        comm.send(out, peer, tag=12)
    assert_equal(buf, values("float32", count, peer), f"rank {comm.rank} from {peer}")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("count", [1, BIG_COUNT])
def test_send_recv_right_after_init(pools: Any, transport: str, count: int) -> None:
    pool = pools.get(5, transport)
    pool.reset()  # fresh communicators: the exchange below is their first operation
    # ranks 0 and 4 sit on different fake hosts in the mixed pool
    pool.run(case_first_op_is_p2p, 0, 4, count)
    pool.reset()
    pool.run(case_first_op_is_p2p, 3, 2, count)


def case_large_messages(comm: Any, count: int) -> None:
    """Ring of large messages (both directions at once): many chunks per message."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    w = comm.isend(make("float32", count, rank), right, tag=3)
    buf = empty("float32", count)
    assert comm.recv(buf, left, tag=3) == left
    w.wait()
    assert_equal(buf, values("float32", count, left), f"rank {rank} from {left}")
    w = comm.isend(make("uint8", count + 3, rank), left, tag=3)
    buf8 = empty("uint8", count + 3)
    comm.irecv(buf8, right, tag=3).wait()
    w.wait()
    assert_equal(buf8, values("uint8", count + 3, right), f"rank {rank} from {right}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages_larger_than_a_chunk(pools: Any, transport: str) -> None:
    pools.get(3, transport).run(case_large_messages, HUGE)


def case_p2p_during_collectives(comm: Any) -> None:
    """Point-to-point progresses independently of collectives: an irecv posted before a
    collective completes while the collective runs, and vice versa."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    rbuf = empty("int32", 100)
    rw = comm.irecv(rbuf, left, tag=21)
    sw = comm.isend(make("int32", 100, rank), right, tag=21)
    a = make("float32", BIG_COUNT, rank, op="sum")
    comm.allreduce(a)
    rw.wait()
    sw.wait()
    assert_equal(rbuf, values("int32", 100, left), "p2p next to allreduce")
    from plait.testing import reference as ref

    assert_equal(a, ref.allreduce([values("float32", BIG_COUNT, r, op="sum")
                                   for r in range(size)], "sum")[rank], "allreduce")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_p2p_alongside_collectives(pools: Any, transport: str) -> None:
    pools.get(4, transport).run(case_p2p_during_collectives)
