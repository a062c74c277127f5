"""Elastic DDP on the plait backend: one rank is SIGKILLed mid-run and the others carry on.

    python examples/elastic_ddp.py                 # 4 workers, rank 2 killed at step 8
    python examples/elastic_ddp.py --victim 0 --kill-at 5 --steps 20

This script is its own launcher: it hosts the TCPStore in the parent process (a store
that outlives any worker, which ``plait.torch.shrink`` needs) and starts 4 worker
processes; torchrun's agent would instead stop every worker as soon as one fails. The
parent SIGKILLs the victim once it has started step ``--kill-at``. The survivors:

1. get an error from DDP (plait's ``PeerFailedError`` naming the lost rank);
2. call ``plait.torch.shrink()``: a process group of the 3 survivors, renumbered in order,
   agreed on by all of them;
3. agree on the step to redo (the first step not every survivor completed, through an
   allreduce on the new group), go back to their in-memory copy of the state before
   that step, rebuild DDP on the new group from their in-memory model and optimizer,
   re-split each step's global batch over 3 ranks, and carry on -- no restart, no
   checkpoint reload.

Then, to show that nothing was lost, the parent runs a fresh 3-rank job started from the
state the survivors resumed from (saved by new rank 0 at that point), with the same data
and seeds, and checks that its losses equal the elastic run's bit for bit. It prints the
timeline (kill -> error on every survivor -> new group -> next step done).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

GLOBAL_BATCH = 48  # divisible by 4 and by 3: every rank gets an equal shard
FEATURES = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 1))
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def shard(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rank::size`` of step ``step``'s global batch (the same on any world size)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x[rank::size], y[rank::size]


def train_step(model: DDP, opt: torch.optim.Optimizer, step: int, group: Any) -> float:
    """One step on ``group``; the global mean squared error of the batch."""
    x, y = shard(step, dist.get_rank(group), dist.get_world_size(group))
    opt.zero_grad()
    err = ((model(x) - y) ** 2)
    err.mean().backward()  # DDP averages the shards' gradients: the global mean's
    opt.step()
    total = err.detach().sum().reshape(1)
    dist.all_reduce(total, group=group)
    return float(total) / GLOBAL_BATCH


def join(rank: int, size: int, port: int, prefix: str) -> dist.TCPStore:
    """Join the parent's store and a plait world under ``prefix``; the store client."""
    import plait.torch  # noqa: F401 - registers the backend (an installed plait does)

    torch.set_num_threads(1)
    st = dist.TCPStore("127.0.0.1", port, is_master=False,
                       timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("plait", store=dist.PrefixStore(prefix, st), rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    return st


def elastic_worker(rank: int, size: int, port: int, steps: int, state_path: str,
                   out: Any) -> None:
    import plait.torch

    st = join(rank, size, port, "elastic/")
    net, opt = make_model()
    group = dist.group.WORLD
    model = DDP(net, process_group=group)
    losses: dict[int, float] = {}
    times: dict[str, Any] = {}
    step = 0  # the next step to run; every step before it is committed
    before: dict[int, Any] = {}  # in-memory state before each of the last two steps
    while step < steps:
        st.set(f"started/{rank}/{step}", "1")  # the parent kills the victim on this
        before[step] = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
        before.pop(step - 2, None)
        try:
            losses[step] = train_step(model, opt, step, group)
            step += 1
        except Exception as exc:  # DDP may wrap plait's PeerFailedError
            times["error"] = time.time()
            times["error_msg"] = str(exc).splitlines()[0][:200]
            group = plait.torch.shrink(group)
            times["group"] = time.time()
            # the step to redo: the first one that not every survivor completed (one may
            # be a step ahead, or have failed after its optimizer step): everyone goes
            # back to the state before it
            mine = torch.tensor([step], dtype=torch.int64)
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
            step = int(mine)
            net.load_state_dict(before[step][0])
            opt.load_state_dict(before[step][1])
            for s in [s for s in losses if s >= step]:
                del losses[s]
            model = DDP(net, process_group=group)
            if dist.get_rank(group) == 0:
                torch.save({"step": step, "model": net.state_dict(),
                            "opt": opt.state_dict()}, state_path)
            dist.barrier(group=group)
            times["resume_step"] = step
            losses[step] = train_step(model, opt, step, group)
            times["next_step"] = time.time()
            step += 1
    out.put(("elastic", rank, losses, times))
    dist.destroy_process_group()


def reference_worker(rank: int, size: int, port: int, steps: int, state_path: str,
                     out: Any) -> None:
    join(rank, size, port, "reference/")
    net, opt = make_model()
    state = torch.load(state_path)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    model = DDP(net)
    losses = {s: train_step(model, opt, s, dist.group.WORLD)
              for s in range(state["step"], steps)}
    out.put(("reference", rank, losses, {}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    n, victim = args.workers, args.victim
    ctx = mp.get_context("spawn")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        state_path = os.path.join(tmp, "resume.pt")
        procs = [ctx.Process(target=elastic_worker,
                             args=(r, n, port, args.steps, state_path, out))
                 for r in range(n)]
        for p in procs:
            p.start()
        server.wait([f"started/{victim}/{args.kill_at}"], datetime.timedelta(seconds=120))
        t_kill = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        print(f"parent: SIGKILLed rank {victim} (pid {procs[victim].pid}) in step "
              f"{args.kill_at}")
        runs = [out.get(timeout=120) for _ in range(n - 1)]
        for p in procs:
            p.join(timeout=30)
        survivors = sorted(r for _, r, _, _ in runs)
        losses = runs[0][2]
        times = [t for _, _, _, t in runs]
        resume = int(times[0]["resume_step"])
        refs = [ctx.Process(target=reference_worker,
                            args=(r, n - 1, port, args.steps, state_path, out))
                for r in range(n - 1)]
        for p in refs:
            p.start()
        ref_runs = [out.get(timeout=120) for _ in refs]
        reference = ref_runs[0][2]
        for p in refs:
            p.join(timeout=30)
    print(f"survivors {survivors} (new ranks 0..{n - 2}), resumed at step {resume}")
    for s in sorted(losses):
        ref = reference.get(s)
        mark = "" if ref is None else ("  == 3-rank reference" if ref == losses[s]
                                       else f"  != reference {ref!r}")
        print(f"step {s:3d}  loss {losses[s]:.8f}{mark}")
    same = all(reference[s] == losses[s] for s in reference) and \
        all(run[2] == losses for run in runs) and all(r[2] == reference for r in ref_runs)
    err = [t["error"] - t_kill for t in times]
    grp = [t["group"] - t_kill for t in times]
    nxt = [t["next_step"] - t_kill for t in times]
    print(f"timeline from the SIGKILL (slowest survivor): error {max(err):.3f} s, new "
          f"group {max(grp):.3f} s, next step done {max(nxt):.3f} s")
    print(f"first error seen: {times[0]['error_msg']}")
    print("after recovery the losses equal a 3-rank run from that state: "
          f"{'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
