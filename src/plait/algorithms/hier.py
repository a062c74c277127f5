"""Hierarchical (topology-aware, rail-aligned) collectives: compositions of flat
collectives on two sub-communicators, each phase chosen by the same selector.

Semantics: those of the flat operation. Preconditions (``registry``'s hier entry): the
communicator spans H >= 2 hosts and every host has the same number L >= 2 of ranks.
Hosts are taken in topology order (``topology.host_order``: hosts of one switch adjacent),
and ``G[B][j]`` is the j-th lowest rank on host B. Each rank (B, i) belongs to

- ``local``: the L ranks of its host (shared memory), ordered by rank;
- ``rail``: the H ranks with the same local index i, one per host, in host order. Local
  rank i binds its TCP traffic to rail i (modulo the rails), so in the inter-host phase
  local rank i talks only to local rank i of other hosts, over rail i: the L rails work
  in parallel, each carrying 1/L of the data (rail-aligned, as in NCCL/ACCL).

The sub-communicators are made at the first hierarchical operation, which every rank
reaches in the same order, by the parent's ``make(tag, ranks)`` (``Communicator._derive``:
through the store, no collective on the parent, which is busy running this operation).
No transport code here, and no knowledge of the Communicator class: only the public
operations of the ``SubGroup`` protocol (algorithms/group.py).

Steps, bytes and cost, with S the message size, alpha/beta_s shared memory, alpha/beta_n
a rail (each rail carries its own flow):

- allreduce: local reduce-scatter (S/L per rank) -> rail allreduce of S/L -> local
  allgather. Network bytes per rank 2 (H-1)/H * S/L, L rails in parallel: ~ 2 (H-1)
  alpha_n + 2 (H-1)/H * S/L * beta_n + 2 (L-1)/L * S * beta_s (ring phases).
  A flat ring sends 2 (N-1)/N * S per rank over one link per host: L times more per link.
- broadcast: local broadcast on the root's host -> rail broadcast of part i (S/L) from the
  root's host -> local allgather of the parts on the other hosts.
- allgather(v): rail allgather of own block -> local allgather of the H gathered blocks
  -> one local copy into rank order. Network bytes per rank (H-1) * S_block.
- reduce_scatter: pack blocks by destination local rank -> local reduce-scatter -> rail
  reduce-scatter of H blocks. Network bytes per rank (H-1) * S_block.
- alltoall(v): local alltoall that gathers, at local rank i, every local rank's blocks for
  local rank i of every host -> rail alltoall: one message per host pair and rail,
  carrying L blocks -> unpack into rank order. (alltoallv first allgathers the send counts
  over shared memory.) Network messages per rank H-1 instead of (H-1) L.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..buffers import Buf
from ..reduce import ReduceOp
from ..topology.order import host_order
from .group import SubGroup
from .schedule import offsets, split_even


def _sub_op(rop: ReduceOp) -> ReduceOp:
    # AVG divides once, at the end, on the parent (comm.py does it after the algorithm)
    return ReduceOp.SUM if rop is ReduceOp.AVG else rop


class HierCall(Protocol):
    """What a hierarchical operation is given (plait.comm.Call)."""

    op: str
    sbuf: Buf | None
    rbuf: Buf | None
    rop: ReduceOp | None
    root: int
    counts: Sequence[int]
    recv_counts: Sequence[int]


MakeGroup = Callable[[str, Sequence[int]], SubGroup]
"""``make(tag, ranks)``: the sub-communicator of the parent's ranks ``ranks`` (in that
order) under key ``tag``."""


class Hier:
    """The two sub-communicators of one communicator, and the hierarchical operations."""

    def __init__(self, topo: Any, rank: int, make: MakeGroup) -> None:
        self.groups = [sorted(h.ranks) for h in host_order(topo)]
        self.H = len(self.groups)
        self.L = len(self.groups[0])
        if self.H < 2 or any(len(g) != self.L for g in self.groups):
            raise ValueError(f"rank {rank}: hierarchical algorithms need equal ranks per "
                             "host on at least two hosts")
        self.b, self.i = next((b, g.index(rank)) for b, g in enumerate(self.groups)
                              if rank in g)
        self.local = make(f"h{self.b}", self.groups[self.b])
        try:
            self.rail = make(f"r{self.i}", [g[self.i] for g in self.groups])
        except BaseException:
            self.local.close()
            raise

    def describe(self) -> dict[str, Any]:
        return {"hosts": self.H, "local": self.L, "local_group": self.local,
                "rail_group": self.rail}

    def run(self, call: HierCall) -> None:
        """Run one operation (the parent's Call) hierarchically."""
        s, r = call.sbuf, call.rbuf
        op = call.op
        if op == "allreduce" and r is not None and call.rop is not None:
            self.allreduce(r, call.rop)
        elif op == "broadcast" and r is not None:
            self.broadcast(r, call.root)
        elif op in ("allgather", "allgatherv") and s is not None and r is not None:
            self.allgatherv(s, r, tuple(call.counts))
        elif op == "reduce_scatter" and s is not None and r is not None \
                and call.rop is not None:
            self.reduce_scatter(s, r, call.rop)
        elif op in ("alltoall", "alltoallv") and s is not None and r is not None:
            self.alltoallv(s, tuple(call.counts), r, tuple(call.recv_counts),
                           uniform=op == "alltoall")
        else:
            raise ValueError(f"hier cannot run {op}")

    def close(self) -> None:
        self.rail.close()
        self.local.close()

    def _where(self, rank: int) -> tuple[int, int]:
        for b, g in enumerate(self.groups):
            if rank in g:
                return b, g.index(rank)
        raise ValueError(rank)

    # -- operations ---------------------------------------------------------------------

    def allreduce(self, buf: Buf, rop: ReduceOp) -> None:
        op = _sub_op(rop)
        counts = split_even(buf.count, self.L)
        mine = Buf(np.empty(counts[self.i], dtype=buf.arr.dtype), buf.dtype)
        # 1. local reduce-scatter: local rank i holds the host's sum of part i
        if buf.count % self.L == 0:
            self.local.reduce_scatter(buf, mine, op)
        else:
            self.local.reduce_scatterv(buf, mine, counts, op)
        # 2. rail allreduce of part i with local rank i of every other host
        self.rail.allreduce(mine, op)
        # 3. local allgather of the parts
        self.local.allgatherv(mine, buf, counts)

    def broadcast(self, buf: Buf, root: int) -> None:
        rb, ri = self._where(root)
        counts = split_even(buf.count, self.L)
        off = offsets(counts)
        # 1. the root's host: everyone gets the data over shared memory
        if self.b == rb:
            self.local.broadcast(buf, ri)
        # 2. part i goes down rail i from the root's host to every other host
        part = Buf(buf.arr[off[self.i]:off[self.i + 1]], buf.dtype)
        self.rail.broadcast(part, rb)
        # 3. other hosts: local allgather of the parts
        if self.b != rb:
            mine = Buf(part.arr.copy(), buf.dtype)
            self.local.allgatherv(mine, buf, counts)

    def allgatherv(self, s: Buf, r: Buf, cnt: tuple[int, ...]) -> None:
        G, H, L = self.groups, self.H, self.L
        dt = r.arr.dtype
        # 1. rail allgather: the blocks of local rank i of every host
        rail_counts = [cnt[G[b][self.i]] for b in range(H)]
        t1 = Buf(np.empty(sum(rail_counts), dtype=dt), r.dtype)
        self.rail.allgatherv(s, t1, rail_counts)
        # 2. local allgather of those: every block, ordered [local rank][host]
        local_counts = [sum(cnt[G[b][j]] for b in range(H)) for j in range(L)]
        t2 = np.empty(sum(local_counts), dtype=dt)
        self.local.allgatherv(t1, Buf(t2, r.dtype), local_counts)
        # 3. into rank order
        goff = offsets(cnt)
        p = 0
        out = r.arr
        for j in range(L):
            for b in range(H):
                g = G[b][j]
                c = cnt[g]
                out[goff[g]:goff[g] + c] = t2[p:p + c]
                p += c

    def reduce_scatter(self, s: Buf, r: Buf, rop: ReduceOp) -> None:
        G, H, L = self.groups, self.H, self.L
        op = _sub_op(rop)
        c = r.count
        dt = r.arr.dtype
        src = s.arr
        # 1. pack blocks by destination: [local rank j][host b] = block of rank G[b][j]
        packed = np.empty(H * L * c, dtype=dt)
        for j in range(L):
            for b in range(H):
                g = G[b][j]
                packed[(j * H + b) * c:(j * H + b + 1) * c] = src[g * c:(g + 1) * c]
        # 2. local reduce-scatter: local rank i holds the host's sums for G[*][i]
        mid = Buf(np.empty(H * c, dtype=dt), r.dtype)
        self.local.reduce_scatter(Buf(packed, s.dtype), mid, op)
        # 3. rail reduce-scatter: host b's rank keeps block b, which is its own
        self.rail.reduce_scatter(mid, r, op)

    def alltoallv(self, s: Buf, sc: tuple[int, ...], r: Buf, rc: tuple[int, ...],
                  uniform: bool) -> None:
        G, H, L, i = self.groups, self.H, self.L, self.i
        dt = r.arr.dtype
        n = len(sc)
        # M[j][g]: what local rank j sends to rank g (alltoallv: exchange the counts)
        if uniform:
            M = np.full((L, n), sc[0] if n else 0, dtype=np.int64)
        else:
            mine = np.asarray(sc, dtype=np.int64)
            allc = np.empty(L * n, dtype=np.int64)
            self.local.allgather(mine, allc)
            M = allc.reshape(L, n)
        # 1. local alltoall: to local rank j, my blocks for G[b][j], b = 0..H-1
        soff = offsets(sc)
        src = s.arr
        send_local = [sum(sc[G[b][j]] for b in range(H)) for j in range(L)]
        packed = np.empty(sum(send_local), dtype=dt)
        p = 0
        for j in range(L):
            for b in range(H):
                g = G[b][j]
                packed[p:p + sc[g]] = src[soff[g]:soff[g] + sc[g]]
                p += sc[g]
        recv_local = [int(sum(M[j][G[b][i]] for b in range(H))) for j in range(L)]
        got = np.empty(sum(recv_local), dtype=dt)
        self._a2a(self.local, Buf(packed, s.dtype), send_local, Buf(got, r.dtype),
                  recv_local)
        # got: [local rank j][host b] = block from G[self.b][j] to G[b][i]
        # 2. rail alltoall: to host b, the L blocks for G[b][i], in local rank order
        loff = offsets(recv_local)
        send_rail = [int(sum(M[j][G[b][i]] for j in range(L))) for b in range(H)]
        to_rail = np.empty(sum(send_rail), dtype=dt)
        p = 0
        for b in range(H):
            for j in range(L):
                q = loff[j] + int(sum(M[j][G[bb][i]] for bb in range(b)))
                c = int(M[j][G[b][i]])
                to_rail[p:p + c] = got[q:q + c]
                p += c
        recv_rail = [sum(rc[G[b][j]] for j in range(L)) for b in range(H)]
        back = np.empty(sum(recv_rail), dtype=dt)
        self._a2a(self.rail, Buf(to_rail, s.dtype), send_rail, Buf(back, r.dtype), recv_rail)
        # 3. back: [host b][local rank j] = block from G[b][j] to me -> rank order
        roff = offsets(rc)
        out = r.arr
        p = 0
        for b in range(H):
            for j in range(L):
                g = G[b][j]
                out[roff[g]:roff[g] + rc[g]] = back[p:p + rc[g]]
                p += rc[g]

    @staticmethod
    def _a2a(sub: SubGroup, s: Buf, sc: list[int], r: Buf, rc: list[int]) -> None:
        if len(set(sc)) == 1 and sc == rc:  # equal blocks: alltoall (direct may apply)
            sub.alltoall(s, r)
        else:
            sub.alltoallv(s, sc, r, rc)
