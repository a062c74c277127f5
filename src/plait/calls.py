"""The argument-normalisation layer of the public API: each collective's arguments,
validated (errors name the rank, the operation and the problem, before any
communication), become one ``Call``: flat numpy views, counts in elements, the reducer,
the sizes selection reads, and what to do after the algorithm (AVG divides once).

plait.comm's methods are one line over these; the selector, the executor, a host
collective and composite algorithms all read the same ``Call``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .args import check_counts, check_rank
from .buffers import Buf, as_buf, expect_count, same_dtype
from .reduce import ReduceOp, Reducer, divide
from .transport.base import HostCall


class Call(HostCall):
    """One operation, validated: what the selector, the executor and a host collective
    need (flat numpy views; counts in elements)."""

    __slots__ = ("nbytes", "post", "rbuf", "recv_counts", "sbuf", "slot_bytes")

    def __init__(self, op: str, send: np.ndarray | None, recv: np.ndarray | None,
                 nbytes: int, slot_bytes: int, dtype: Any, reducer: Reducer | None = None,
                 rop: ReduceOp | None = None, root: int = 0, counts: Sequence[int] = (),
                 recv_counts: Sequence[int] = (), sbuf: Buf | None = None,
                 rbuf: Buf | None = None) -> None:
        super().__init__(op, send, recv, reducer, root, counts, dtype, rop)
        self.recv_counts = recv_counts
        self.nbytes = nbytes
        self.slot_bytes = slot_bytes
        self.sbuf = sbuf
        self.rbuf = rbuf
        self.post: Callable[[], None] | None = None


def storage(call: Call) -> np.dtype:
    arr = call.recv if call.recv is not None else call.send
    return arr.dtype if arr is not None else np.dtype(np.uint8)


class Calls:
    """Builds the Calls of one communicator (rank ``rank`` of ``size``), caching the
    reducer per (reduce op, dtype)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._red_cache: dict[tuple[Any, str], tuple[ReduceOp, Reducer]] = {}

    def buf(self, obj: Any, op: str, arg: str, writable: bool = False) -> Buf:
        return as_buf(obj, rank=self.rank, op=op, arg=arg, writable=writable)

    def reducer(self, op: Any, b: Buf, name: str) -> tuple[ReduceOp, Reducer]:
        try:
            key = (op, b.dtype.name)
            hit = self._red_cache.get(key)
        except TypeError:  # an unhashable op object
            key, hit = None, None
        if hit is not None:
            return hit
        rop = ReduceOp.parse(op, rank=self.rank, opname=name)
        pair = rop, b.dtype.reducer(rop, rank=self.rank, opname=name)
        if key is not None:
            self._red_cache[key] = pair
        return pair

    def root(self, root: Any, op: str) -> int:
        return check_rank(root, self.size, self.rank, op, "root")


    def allreduce(self, buf: Any, op: Any = "sum") -> Call:
        b = self.buf(buf, "allreduce", "buf", writable=True)
        rop, reducer = self.reducer(op, b, "allreduce")
        arr = b.arr
        call = Call("allreduce", arr, arr, b.nbytes, b.nbytes, b.dtype, reducer, rop,
                    counts=(b.count,), rbuf=b)
        if rop is ReduceOp.AVG:
            call.post = lambda: divide(arr, b.dtype, self.size)
        return call

    def reduce(self, buf: Any, root: int, op: Any = "sum") -> Call:
        root = self.root(root, "reduce")
        b = self.buf(buf, "reduce", "buf", writable=self.rank == root)
        rop, reducer = self.reducer(op, b, "reduce")
        arr = b.arr
        call = Call("reduce", arr, arr, b.nbytes, b.nbytes, b.dtype, reducer, rop, root,
                    counts=(b.count,), rbuf=b)
        if rop is ReduceOp.AVG and self.rank == root:
            call.post = lambda: divide(arr, b.dtype, self.size)
        return call

    def broadcast(self, buf: Any, root: int) -> Call:
        root = self.root(root, "broadcast")
        b = self.buf(buf, "broadcast", "buf", writable=self.rank != root)
        return Call("broadcast", b.arr, b.arr, b.nbytes, b.nbytes, b.dtype,
                                 root=root, counts=(b.count,), rbuf=b)

    def allgather(self, sendbuf: Any, recvbuf: Any) -> Call:
        s = self.buf(sendbuf, "allgather", "sendbuf")
        r = self.buf(recvbuf, "allgather", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="allgather")
        expect_count(r, self.size * s.count, rank=self.rank, op="allgather", arg="recvbuf",
                     why=f"{self.size} ranks x {s.count} elements of sendbuf")
        return self._allgatherv("allgather", s, r, (s.count,) * self.size)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int]) -> Call:
        s = self.buf(sendbuf, "allgatherv", "sendbuf")
        r = self.buf(recvbuf, "allgatherv", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="allgatherv")
        cnt = check_counts(counts, self.size, self.rank, "allgatherv", "counts")
        expect_count(s, cnt[self.rank], rank=self.rank, op="allgatherv", arg="sendbuf",
                     why=f"counts[{self.rank}]")
        expect_count(r, sum(cnt), rank=self.rank, op="allgatherv", arg="recvbuf",
                     why="the sum of counts")
        return self._allgatherv("allgatherv", s, r, cnt)

    def _allgatherv(self, name: str, s: Buf, r: Buf, cnt: tuple[int, ...]) -> Call:
        slot = max(cnt) * s.dtype.itemsize if cnt else 0
        return Call(name, s.arr, r.arr, r.nbytes, slot, s.dtype, counts=cnt,
                                 sbuf=s, rbuf=r)

    def gather(self, sendbuf: Any, recvbuf: Any, root: int) -> Call:
        root = self.root(root, "gather")
        s = self.buf(sendbuf, "gather", "sendbuf")
        rarr = None
        if self.rank == root:
            if recvbuf is None:
                raise ValueError(f"rank {self.rank}, gather: recvbuf is required on the root")
            r = self.buf(recvbuf, "gather", "recvbuf", writable=True)
            same_dtype(s, r, rank=self.rank, op="gather")
            expect_count(r, self.size * s.count, rank=self.rank, op="gather", arg="recvbuf",
                         why=f"{self.size} ranks x {s.count} elements of sendbuf")
            rarr = r.arr
        return Call("gather", s.arr, rarr, s.nbytes * self.size, s.nbytes,
                                 s.dtype, root=root, counts=(s.count,))

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int) -> Call:
        root = self.root(root, "scatter")
        r = self.buf(recvbuf, "scatter", "recvbuf", writable=True)
        sarr = None
        if self.rank == root:
            if sendbuf is None:
                raise ValueError(f"rank {self.rank}, scatter: sendbuf is required on the root")
            s = self.buf(sendbuf, "scatter", "sendbuf")
            same_dtype(s, r, rank=self.rank, op="scatter")
            expect_count(s, self.size * r.count, rank=self.rank, op="scatter", arg="sendbuf",
                         why=f"{self.size} ranks x {r.count} elements of recvbuf")
            sarr = s.arr
        n = r.nbytes * self.size
        return Call("scatter", sarr, r.arr, n, n, r.dtype, root=root,
                                 counts=(r.count,))

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum") -> Call:
        s = self.buf(sendbuf, "reduce_scatter", "sendbuf")
        r = self.buf(recvbuf, "reduce_scatter", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="reduce_scatter")
        expect_count(s, self.size * r.count, rank=self.rank, op="reduce_scatter",
                     arg="sendbuf", why=f"{self.size} ranks x {r.count} elements of recvbuf")
        return self._reduce_scatterv("reduce_scatter", s, r, (r.count,) * self.size, op)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: Any = "sum") -> Call:
        s = self.buf(sendbuf, "reduce_scatterv", "sendbuf")
        r = self.buf(recvbuf, "reduce_scatterv", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="reduce_scatterv")
        cnt = check_counts(counts, self.size, self.rank, "reduce_scatterv", "counts")
        expect_count(s, sum(cnt), rank=self.rank, op="reduce_scatterv", arg="sendbuf",
                     why="the sum of counts")
        expect_count(r, cnt[self.rank], rank=self.rank, op="reduce_scatterv", arg="recvbuf",
                     why=f"counts[{self.rank}]")
        return self._reduce_scatterv("reduce_scatterv", s, r, cnt, op)

    def _reduce_scatterv(self, name: str, s: Buf, r: Buf, cnt: tuple[int, ...],
                         op: Any) -> Call:
        rop, reducer = self.reducer(op, s, name)
        rarr = r.arr
        call = Call(name, s.arr, rarr, s.nbytes, s.nbytes, s.dtype, reducer, rop,
                    counts=cnt, sbuf=s, rbuf=r)
        if rop is ReduceOp.AVG:
            call.post = lambda: divide(rarr, r.dtype, self.size)
        return call

    def alltoall(self, sendbuf: Any, recvbuf: Any) -> Call:
        s = self.buf(sendbuf, "alltoall", "sendbuf")
        r = self.buf(recvbuf, "alltoall", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="alltoall")
        if s.count % self.size:
            raise ValueError(f"rank {self.rank}, alltoall: sendbuf has {s.count} elements, not "
                             f"a multiple of the {self.size} ranks")
        expect_count(r, s.count, rank=self.rank, op="alltoall", arg="recvbuf",
                     why="the same as sendbuf")
        c = s.count // self.size
        return self._alltoallv("alltoall", s, (c,) * self.size, r, (c,) * self.size)

    def alltoallv(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any,
                  recv_counts: Sequence[int]) -> Call:
        s = self.buf(sendbuf, "alltoallv", "sendbuf")
        r = self.buf(recvbuf, "alltoallv", "recvbuf", writable=True)
        same_dtype(s, r, rank=self.rank, op="alltoallv")
        sc = check_counts(send_counts, self.size, self.rank, "alltoallv", "send_counts")
        rc = check_counts(recv_counts, self.size, self.rank, "alltoallv", "recv_counts")
        expect_count(s, sum(sc), rank=self.rank, op="alltoallv", arg="sendbuf",
                     why="the sum of send_counts")
        expect_count(r, sum(rc), rank=self.rank, op="alltoallv", arg="recvbuf",
                     why="the sum of recv_counts")
        return self._alltoallv("alltoallv", s, sc, r, rc)

    def _alltoallv(self, name: str, s: Buf, sc: tuple[int, ...], r: Buf,
                   rc: tuple[int, ...]) -> Call:
        return Call(name, s.arr, r.arr, s.nbytes, s.nbytes, s.dtype, counts=sc,
                    recv_counts=rc, sbuf=s, rbuf=r)

    def barrier(self) -> Call:
        empty = np.empty(0, dtype=np.uint8)
        return Call("barrier", empty, empty, 0, 0, None)
