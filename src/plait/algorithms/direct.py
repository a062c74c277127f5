"""Direct shared-memory algorithms, for small messages when every rank is on one host.

Not point-to-point: every rank writes its contribution into its own slot of the
communicator's segment, publishes a sequence number, waits until the ranks it needs have
published, and reads their slots directly. Slots are double-buffered; a rank reuses a slot
only after every rank has finished reading it (two operations later), so one exchange
costs one write, one wait and the reads — no message per peer. Reductions run in rank
order on every rank, so every rank gets bit-identical results.
Cost: alpha_shm + S * (n reads) + n * gamma S.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..reduce import Reducer


class Board:
    """What the direct algorithms need from shared memory (see transport.shm.SlotBoard)."""

    me: int
    n: int
    slot_size: int

    def begin(self, ctx: Any) -> tuple[int, np.ndarray]: ...
    def publish(self, s: int) -> None: ...
    def wait_for(self, s: int, ranks: list[int] | None, ctx: Any) -> None: ...
    def finish(self, s: int) -> None: ...
    def typed(self, s: int, dtype: np.dtype, start: int, count: int) -> list[np.ndarray]: ...


def _typed(slots: np.ndarray, rank: int, count: int, storage: np.dtype, start: int = 0
           ) -> np.ndarray:
    size = storage.itemsize
    return slots[rank, start * size:(start + count) * size].view(storage)


def _reduce_rows(slots: np.ndarray, n: int, out: np.ndarray, start: int, reducer: Reducer
                 ) -> None:
    count = len(out)
    np.copyto(out, _typed(slots, 0, count, out.dtype, start))
    for k in range(1, n):
        reducer(out, _typed(slots, k, count, out.dtype, start))


def allreduce(b: Board, ctx: Any, buf: np.ndarray, reducer: Reducer) -> None:
    s, _ = b.begin(ctx)
    rows = b.typed(s, buf.dtype, 0, len(buf))
    np.copyto(rows[b.me], buf)
    b.publish(s)
    b.wait_for(s, None, ctx)
    np.copyto(buf, rows[0])
    for k in range(1, b.n):
        reducer(buf, rows[k])
    b.finish(s)


def reduce(b: Board, ctx: Any, buf: np.ndarray, reducer: Reducer, root: int) -> None:
    s, slots = b.begin(ctx)
    if b.me != root:
        np.copyto(slots[b.me, :buf.nbytes], buf.view(np.uint8))
        b.publish(s)
        b.finish(s)
        return
    np.copyto(slots[b.me, :buf.nbytes], buf.view(np.uint8))
    b.publish(s)
    b.wait_for(s, None, ctx)
    _reduce_rows(slots, b.n, buf, 0, reducer)
    b.finish(s)


def broadcast(b: Board, ctx: Any, buf: np.ndarray, root: int) -> None:
    s, slots = b.begin(ctx)
    if b.me == root:
        np.copyto(slots[root, :buf.nbytes], buf.view(np.uint8))
        b.publish(s)
    else:
        b.publish(s)
        b.wait_for(s, [root], ctx)
        np.copyto(buf.view(np.uint8), slots[root, :buf.nbytes])
    b.finish(s)


def allgatherv(b: Board, ctx: Any, send: np.ndarray, out: np.ndarray,
               counts: tuple[int, ...]) -> None:
    s, slots = b.begin(ctx)
    np.copyto(slots[b.me, :send.nbytes], send.view(np.uint8))
    b.publish(s)
    b.wait_for(s, None, ctx)
    off = 0
    for k in range(b.n):
        c = counts[k]
        np.copyto(out[off:off + c], _typed(slots, k, c, out.dtype))
        off += c
    b.finish(s)


def gather(b: Board, ctx: Any, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
    s, slots = b.begin(ctx)
    np.copyto(slots[b.me, :send.nbytes], send.view(np.uint8))
    b.publish(s)
    if b.me == root:
        assert out is not None
        b.wait_for(s, None, ctx)
        c = len(send)
        for k in range(b.n):
            np.copyto(out[k * c:(k + 1) * c], _typed(slots, k, c, out.dtype))
    b.finish(s)


def scatter(b: Board, ctx: Any, send: np.ndarray | None, out: np.ndarray, root: int) -> None:
    s, slots = b.begin(ctx)
    c = len(out)
    if b.me == root:
        assert send is not None
        np.copyto(slots[root, :send.nbytes], send.view(np.uint8))
        b.publish(s)
        np.copyto(out, send[root * c:(root + 1) * c])
    else:
        b.publish(s)
        b.wait_for(s, [root], ctx)
        np.copyto(out, _typed(slots, root, c, out.dtype, b.me * c))
    b.finish(s)


def reduce_scatter(b: Board, ctx: Any, send: np.ndarray, out: np.ndarray,
                   reducer: Reducer) -> None:
    s, slots = b.begin(ctx)
    np.copyto(slots[b.me, :send.nbytes], send.view(np.uint8))
    b.publish(s)
    b.wait_for(s, None, ctx)
    _reduce_rows(slots, b.n, out, b.me * len(out), reducer)
    b.finish(s)


def alltoall(b: Board, ctx: Any, send: np.ndarray, out: np.ndarray) -> None:
    s, slots = b.begin(ctx)
    np.copyto(slots[b.me, :send.nbytes], send.view(np.uint8))
    b.publish(s)
    b.wait_for(s, None, ctx)
    c = len(out) // b.n if b.n else 0
    for k in range(b.n):
        np.copyto(out[k * c:(k + 1) * c], _typed(slots, k, c, out.dtype, b.me * c))
    b.finish(s)


def barrier(b: Board, ctx: Any) -> None:
    s, _ = b.begin(ctx)
    b.publish(s)
    b.wait_for(s, None, ctx)
    b.finish(s)
