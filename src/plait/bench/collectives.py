"""Per-collective hooks of the timing loop: sizes, busbw factor, exact data, expected result.

One :class:`Collective` per operation, as nccl-tests has one ``src/<coll>.cu`` each. The
loop in :mod:`plait.bench.loop` knows nothing about any operation: it asks the collective
for buffer sizes, for :class:`Case` objects (one per mode, out-of-place and in-place) that
fill, re-fill and check buffers, and for the factor that turns algorithm bandwidth into
bus bandwidth.

Sizes follow nccl-tests: a row's ``size`` is the largest buffer of the operation in bytes
(allgather's and gather's output, reduce_scatter's, alltoall's and scatter's input), and
``count`` is that size in elements. Operations that split a buffer into one chunk per rank
round the count down to a multiple of the rank count; a size too small to give every rank
one element is skipped.

Data is exact (nccl-tests ``verifiable``): small integers depending on rank and element
index, so sums, products, minima and maxima are exact in every element type and in any
order, and a chunk placed at a wrong offset fails the check.

Modes (nccl-tests' two column groups):

- out-of-place: separate input and output buffers. plait's and torch's allreduce, reduce
  and broadcast work in place by API; their out-of-place time therefore includes copying
  the input into the output first — what a caller who needs both buffers pays.
- in-place: allreduce/reduce/broadcast on one buffer; allgather and gather with the input
  being this rank's chunk of the output; reduce_scatter and scatter with the output being
  this rank's chunk of the input. alltoall and sendrecv have no in-place form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MODES = ("out", "in")
"""``out``: out-of-place, ``in``: in-place."""

_BF16 = "bfloat16"


def storage_dtype(dtype: str) -> np.dtype:
    """numpy storage of an element type (bfloat16 travels as uint16)."""
    return np.dtype(np.uint16) if dtype == _BF16 else np.dtype(dtype)


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """int64 or float64 values -> storage array of ``dtype`` (exact for our small integers)."""
    if dtype == _BF16:
        import torch

        t = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16)
    return values.astype(dtype)


def to_float64(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array -> float64 values (for comparisons with a tolerance)."""
    if dtype == _BF16:
        import torch

        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).double().numpy()
    return arr.astype(np.float64)


def pattern(rank: int, start: int, n: int, dtype: str, redop: str) -> np.ndarray:
    """Rank ``rank``'s exact values for elements ``start .. start+n`` of its input.

    Sums of up to 16 ranks stay within [-128, 128] (exact even in bfloat16); for ``prod``
    the values are 1, 2 and -1, so a product over n ranks is at most 2**n in magnitude.
    """
    idx = np.arange(start, start + n, dtype=np.int64)
    unsigned = dtype.startswith("uint")
    if redop == "prod":
        table = np.array([1, 2, 1] if unsigned else [1, 2, -1], dtype=np.int64)
        values = table[(idx + rank) % 3]
    else:
        values = (idx * 7 + rank * 3) % 17
        if not unsigned:
            values -= 8
    return _cast(values, dtype)


def poison(dtype: str) -> np.ndarray:
    """A value that no correct result holds: written into outputs before a checked call."""
    return _cast(np.array([99 if dtype.startswith("uint") else -99]), dtype)


_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum}


def reduce_ranks(n: int, start: int, count: int, dtype: str, redop: str) -> np.ndarray:
    """The expected reduction over ranks 0..n-1 of ``pattern(r, start, count)``."""
    calc = np.dtype(np.float32) if dtype == _BF16 else storage_dtype(dtype)
    ufunc = _UFUNC[redop]
    acc = to_float64(pattern(0, start, count, dtype, redop), dtype).astype(calc)
    for r in range(1, n):
        other = to_float64(pattern(r, start, count, dtype, redop), dtype).astype(calc)
        ufunc(acc, other, out=acc)
    if redop == "avg":
        acc = np.true_divide(acc, calc.type(n)).astype(calc)
    return _cast(acc, dtype) if dtype == _BF16 else acc


def count_wrong(got: np.ndarray, expected: np.ndarray, dtype: str, redop: str) -> int:
    """Mismatching elements; exact except for ``avg`` (one division, rounded per dtype)."""
    if got.shape != expected.shape:
        raise ValueError(f"result has {got.shape} elements, expected {expected.shape}")
    if redop == "avg":
        eps = {"float16": 1e-3, _BF16: 8e-3, "float32": 1e-6}.get(dtype, 1e-14)
        ok = np.isclose(to_float64(got, dtype), to_float64(expected, dtype), rtol=eps, atol=0)
        return int(np.count_nonzero(~ok))
    return int(np.count_nonzero(got != expected))


@dataclass
class Case:
    """One mode of one collective on this rank: the buffers a backend call uses.

    ``send``/``recv`` are views into the run's storage (``None`` where the operation has no
    such buffer on this rank). ``fill`` writes exact input and poisons the output,
    ``steady`` writes input that stays bounded when the call is repeated in place (the
    timed iterations do not re-fill), and ``check`` counts wrong elements after one call.
    """

    send: np.ndarray | None
    recv: np.ndarray | None
    fill: Callable[[], None]
    steady: Callable[[], None]
    check: Callable[[], int]


@dataclass(frozen=True)
class Layout:
    size: int  # bytes, as nccl-tests prints it
    count: int  # elements of the largest buffer
    chunk: int  # elements per rank (count for unchunked operations)


@dataclass
class Collective:
    """Hooks of one operation; subclasses fill in :meth:`cases`."""

    name: str
    chunked: bool  # the largest buffer is split into one chunk per rank
    rooted: bool = False
    reduces: bool = False
    in_place: bool = True
    _expected: dict[tuple[object, ...], np.ndarray] = field(default_factory=dict, repr=False)

    def bus_factor(self, n: int) -> float:
        """nccl-tests ``PERFORMANCE.md``: busbw = algbw x this factor."""
        return 1.0

    def layout(self, nbytes: int, itemsize: int, n: int) -> Layout | None:
        count = nbytes // itemsize
        chunk = count // n if self.chunked else count
        if chunk == 0:
            return None
        if self.chunked:
            count = chunk * n
        return Layout(count * itemsize, count, chunk)

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        raise NotImplementedError

    # helpers shared by the subclasses
    def expected(self, key: tuple[object, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
        """Expected results are computed once per size and shared by backends and modes."""
        if key not in self._expected:
            self._expected.clear()
            self._expected[key] = make()
        return self._expected[key]


def _alloc(count: int, dtype: str) -> np.ndarray:
    a = np.empty(count, storage_dtype(dtype))
    a.fill(0)  # touch every page now, not inside a timed call
    return a


def _checker(result: Callable[[], np.ndarray | None], expected: Callable[[], np.ndarray],
             dtype: str, redop: str) -> Callable[[], int]:
    def check() -> int:
        got = result()
        return 0 if got is None else count_wrong(got, expected(), dtype, redop)

    return check


class AllReduce(Collective):
    root_only = False
    """Reduce: only the root's output is defined (MPI leaves other ranks' untouched)."""

    def bus_factor(self, n: int) -> float:
        return 2.0 * (n - 1) / n

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        data = pattern(rank, 0, lay.count, dtype, redop)
        bad = poison(dtype)
        send, recv = _alloc(lay.count, dtype), _alloc(lay.count, dtype)
        inplace = _alloc(lay.count, dtype)
        defined = not self.root_only or rank == root

        def expected() -> np.ndarray:
            return self.expected((lay, n, dtype, redop),
                                 lambda: reduce_ranks(n, 0, lay.count, dtype, redop))

        def fill_out() -> None:
            send[:] = data
            recv[:] = bad

        def fill_in() -> None:
            inplace[:] = data

        def zero() -> None:
            inplace.fill(0)

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv if defined else None, expected, dtype, redop)),
            "in": Case(None, inplace, fill_in, zero,
                       _checker(lambda: inplace if defined else None, expected, dtype,
                                redop)),
        }


class Reduce(AllReduce):
    root_only = True

    def bus_factor(self, n: int) -> float:
        return 1.0


class Broadcast(Collective):
    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        data = pattern(root, 0, lay.count, dtype, redop)
        bad = poison(dtype)
        send = _alloc(lay.count, dtype) if rank == root else None
        recv, inplace = _alloc(lay.count, dtype), _alloc(lay.count, dtype)

        def fill_out() -> None:
            if send is not None:
                send[:] = data
            recv[:] = bad

        def fill_in() -> None:
            inplace[:] = data if rank == root else bad

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv, lambda: data, dtype, redop)),
            "in": Case(None, inplace, fill_in, fill_in,
                       _checker(lambda: inplace, lambda: data, dtype, redop)),
        }


class AllGather(Collective):
    def bus_factor(self, n: int) -> float:
        return (n - 1) / n

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        c = lay.chunk
        data = pattern(rank, 0, c, dtype, redop)
        bad = poison(dtype)
        send, recv, inplace = _alloc(c, dtype), _alloc(lay.count, dtype), _alloc(lay.count, dtype)
        mine = inplace[rank * c:(rank + 1) * c]

        def expected() -> np.ndarray:
            return self.expected((lay, n, dtype), lambda: np.concatenate(
                [pattern(r, 0, c, dtype, redop) for r in range(n)]))

        def fill_out() -> None:
            send[:] = data
            recv[:] = bad

        def fill_in() -> None:
            inplace[:] = bad
            mine[:] = data

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv, expected, dtype, redop)),
            "in": Case(mine, inplace, fill_in, fill_in,
                       _checker(lambda: inplace, expected, dtype, redop)),
        }


class ReduceScatter(Collective):
    def bus_factor(self, n: int) -> float:
        return (n - 1) / n

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        c = lay.chunk
        data = pattern(rank, 0, lay.count, dtype, redop)
        bad = poison(dtype)
        send, recv, inplace = _alloc(lay.count, dtype), _alloc(c, dtype), _alloc(lay.count, dtype)
        mine = inplace[rank * c:(rank + 1) * c]

        def expected() -> np.ndarray:
            return self.expected((lay, n, rank, dtype, redop),
                                 lambda: reduce_ranks(n, rank * c, c, dtype, redop))

        def fill_out() -> None:
            send[:] = data
            recv[:] = bad

        def fill_in() -> None:
            inplace[:] = data

        def zero() -> None:
            inplace.fill(0)

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv, expected, dtype, redop)),
            "in": Case(inplace, mine, fill_in, zero,
                       _checker(lambda: mine, expected, dtype, redop)),
        }


class AllToAll(Collective):
    def bus_factor(self, n: int) -> float:
        return (n - 1) / n

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        c = lay.chunk
        data = pattern(rank, 0, lay.count, dtype, redop)
        bad = poison(dtype)
        send, recv = _alloc(lay.count, dtype), _alloc(lay.count, dtype)

        def expected() -> np.ndarray:
            # chunk j of the output is chunk `rank` of rank j's input
            return self.expected((lay, n, rank, dtype), lambda: np.concatenate(
                [pattern(j, rank * c, c, dtype, redop) for j in range(n)]))

        def fill() -> None:
            send[:] = data
            recv[:] = bad

        return {"out": Case(send, recv, fill, fill,
                            _checker(lambda: recv, expected, dtype, redop))}


class Gather(Collective):
    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        c = lay.chunk
        data = pattern(rank, 0, c, dtype, redop)
        bad = poison(dtype)
        is_root = rank == root
        send = _alloc(c, dtype)
        recv = _alloc(lay.count, dtype) if is_root else None
        inplace = _alloc(lay.count, dtype) if is_root else None
        in_send = inplace[root * c:(root + 1) * c] if inplace is not None else send

        def expected() -> np.ndarray:
            return self.expected((lay, n, dtype), lambda: np.concatenate(
                [pattern(r, 0, c, dtype, redop) for r in range(n)]))

        def fill_out() -> None:
            send[:] = data
            if recv is not None:
                recv[:] = bad

        def fill_in() -> None:
            if inplace is not None:
                inplace[:] = bad
            in_send[:] = data

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv, expected, dtype, redop)),
            "in": Case(in_send, inplace, fill_in, fill_in,
                       _checker(lambda: inplace, expected, dtype, redop)),
        }


class Scatter(Collective):
    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        c = lay.chunk
        is_root = rank == root
        data = pattern(root, 0, lay.count, dtype, redop) if is_root else None
        expect = pattern(root, rank * c, c, dtype, redop)
        bad = poison(dtype)
        send = _alloc(lay.count, dtype) if is_root else None
        recv = _alloc(c, dtype)
        inplace = _alloc(lay.count, dtype) if is_root else None
        in_recv = inplace[root * c:(root + 1) * c] if inplace is not None else _alloc(c, dtype)

        def fill_out() -> None:
            if send is not None:
                send[:] = data
            recv[:] = bad

        def fill_in() -> None:
            if inplace is not None:
                inplace[:] = data
            else:
                in_recv[:] = bad

        return {
            "out": Case(send, recv, fill_out, fill_out,
                        _checker(lambda: recv, lambda: expect, dtype, redop)),
            "in": Case(inplace, in_recv, fill_in, fill_in,
                       _checker(lambda: in_recv, lambda: expect, dtype, redop)),
        }


class SendRecv(Collective):
    """Every rank sends to rank+1 and receives from rank-1 at the same time (a ring shift)."""

    def cases(self, lay: Layout, rank: int, n: int, root: int, dtype: str,
              redop: str) -> dict[str, Case]:
        data = pattern(rank, 0, lay.count, dtype, redop)
        expect = pattern((rank - 1) % n, 0, lay.count, dtype, redop)
        bad = poison(dtype)
        send, recv = _alloc(lay.count, dtype), _alloc(lay.count, dtype)

        def fill() -> None:
            send[:] = data
            recv[:] = bad

        return {"out": Case(send, recv, fill, fill,
                            _checker(lambda: recv, lambda: expect, dtype, redop))}


def collective(name: str) -> Collective:
    """The hooks of operation ``name`` (one of :data:`plait.bench.options.OPS`)."""
    table: dict[str, Callable[[], Collective]] = {
        "allreduce": lambda: AllReduce(name, chunked=False, reduces=True),
        "reduce": lambda: Reduce(name, chunked=False, rooted=True, reduces=True),
        "broadcast": lambda: Broadcast(name, chunked=False, rooted=True),
        "allgather": lambda: AllGather(name, chunked=True),
        "reduce_scatter": lambda: ReduceScatter(name, chunked=True, reduces=True),
        "alltoall": lambda: AllToAll(name, chunked=True, in_place=False),
        "gather": lambda: Gather(name, chunked=True, rooted=True),
        "scatter": lambda: Scatter(name, chunked=True, rooted=True),
        "sendrecv": lambda: SendRecv(name, chunked=False, in_place=False),
    }
    return table[name]()
