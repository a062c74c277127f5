"""What a composite algorithm (algorithms/hier.py) may ask of its sub-communicators: their
public operations only. plait.Communicator implements it; nothing here knows that class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class SubGroup(Protocol):
    rank: int
    size: int

    def allreduce(self, buf: Any, op: Any = ..., *, async_op: bool = ...) -> Any: ...

    def broadcast(self, buf: Any, root: int, *, async_op: bool = ...) -> Any: ...

    def allgather(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = ...) -> Any: ...

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                   async_op: bool = ...) -> Any: ...

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = ..., *,
                       async_op: bool = ...) -> Any: ...

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: Any = ..., *, async_op: bool = ...) -> Any: ...

    def alltoall(self, sendbuf: Any, recvbuf: Any, *, async_op: bool = ...) -> Any: ...

    def alltoallv(self, sendbuf: Any, send_counts: Sequence[int], recvbuf: Any,
                  recv_counts: Sequence[int], *, async_op: bool = ...) -> Any: ...

    def close(self) -> None: ...
