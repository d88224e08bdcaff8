"""One process of a system bench/peers.py compares with dynabatch: PyTorch DDP, hivemind's Optimizer, or one
machine alone.

Every system trains what `dynabatch run`'s default job trains: the CNN on Fashion-MNIST
built under the job's seed, SGD with the job's momentum and weight decay; worker i
draws the samples a dynabatch worker wi draws (worker/batch_source.py's order) and is
slowed down as a dynabatch worker is (a factor F idles F-1 times the CPU time of each
forward and backward pass, common/slowdown.py). Worker 0 saves the model every
--snapshot-s seconds, with the wall time and the samples the whole system has trained,
for bench/peers.py to score afterwards; no process evaluates anything.

    torchrun --standalone --nproc-per-node 4 -m bench.peer_train --system ddp --slowdowns 1 1 2 4 ...
    python -m bench.peer_train --system alone --slowdowns 1 ...
    python -m bench.peer_train --system hivemind --rank R --peers-file FILE ...   # one per peer

DDP is started as its docs start it (torchrun, which sets RANK and WORLD_SIZE; gloo on CPU);
hivemind as its quickstart does (a DHT, the first peer's address handed to the others,
`hivemind.Optimizer` around the local optimizer, the newest state loaded from peers on joining).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dynabatch.common.config import JobConfig
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.tasks.data import Dataset, SampleOrder, load_dataset, make_batch
from dynabatch.common.tasks.models import model_for_job
from dynabatch.worker.batch_source import worker_order

SYSTEMS = ("ddp", "alone", "hivemind")
PEERS_FILE_WAIT_S = 120.0


@dataclass
class Setup:
    """What every system's worker starts from: the job's model, its training set and this worker's order."""

    job: JobConfig
    model: torch.nn.Module
    data: Dataset
    order: SampleOrder
    generator: torch.Generator


def setup(rank: int, seed: int, data_dir: str) -> Setup:
    """Worker `rank`'s start, as a dynabatch worker w`rank` of a job of `seed` starts (one torch thread)."""
    torch.set_num_threads(1)
    job = JobConfig(model="cnn", dataset="fashion-mnist", seed=seed)
    data = load_dataset(job.dataset, data_dir or None)
    return Setup(
        job,
        model_for_job(job),
        data,
        worker_order(len(data.train_y), seed, rank),
        torch.Generator().manual_seed(seed * 7919 + rank),
    )


def sgd(model: torch.nn.Module, job: JobConfig, lr: float) -> torch.optim.SGD:
    """The shards' optimizer, as the job configures it, at step size `lr`."""
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=job.momentum, weight_decay=job.weight_decay, nesterov=job.nesterov
    )


class Snapshots:
    """Worker 0's model saved every `every_s` seconds into `folder` (atomically: a reader never sees half a file)."""

    def __init__(self, folder: Path | None, every_s: float) -> None:
        self.folder, self.every_s = folder, every_s
        self.count, self.next_at = 0, time.time()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def maybe(self, model: torch.nn.Module, samples: int, force: bool = False) -> None:
        now = time.time()
        if self.folder is None or (now < self.next_at and not force):
            return
        self.next_at = now + self.every_s
        path = self.folder / f"{self.count:04d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"state": model.state_dict(), "t": now, "samples": samples}, tmp)
        os.replace(tmp, path)
        self.count += 1


def slowed_step(
    s: Setup, batch: int, slowdown: Slowdown, started: float, backward: Callable[[torch.Tensor], None]
) -> None:
    """Forward and backward of one batch, then the emulated slowdown's idle (F-1 times their CPU time)."""
    x, y = make_batch(s.data, s.order.take(batch), True, s.generator)
    cpu = time.thread_time()
    backward(F.cross_entropy(s.model(x), y))
    factor = slowdown.factor(time.monotonic() - started)
    if factor > 1.0:
        time.sleep((factor - 1.0) * (time.thread_time() - cpu))


@contextmanager
def gloo_group(**init: Any) -> Iterator[None]:
    """A Gloo process group around the body, destroyed only once what the body made of it (DDP, its optimizer) is
    collected: the body makes them in a function of its own, which has returned. While DDP holds the group,
    Gloo's worker threads outlive `destroy_process_group` into the interpreter's finalization, where a rank aborts
    now and then ("terminate called without an active exception"; bench/RESULTS.md 37)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", **init)
    try:
        yield
        gc.collect()
    finally:
        dist.destroy_process_group()


def all_done(done: bool) -> bool:
    """Whether any rank is done (one all-reduce), so that every rank takes the same number of steps."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if done else 0.0])
    dist.all_reduce(flag)
    return flag.item() > 0


def train_ddp(args: argparse.Namespace) -> None:
    with gloo_group():
        _ddp_steps(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def _ddp_steps(args: argparse.Namespace, rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    s = setup(rank, args.seed, args.data_dir)
    ddp = DistributedDataParallel(s.model)
    opt = sgd(ddp, s.job, args.lr)
    slowdown, started = Slowdown.parse(args.slowdowns[rank]), time.monotonic()
    snaps = Snapshots(args.snapshots if rank == 0 else None, args.snapshot_s)
    steps = 0
    while not all_done(time.time() >= args.deadline):
        snaps.maybe(s.model, steps * args.batch * world)
        opt.zero_grad(set_to_none=False)
        slowed_step(s, args.batch, slowdown, started, lambda loss: torch.autograd.backward(loss))
        opt.step()
        steps += 1
    snaps.maybe(s.model, steps * args.batch * world, force=True)


def train_alone(args: argparse.Namespace) -> None:
    s = setup(0, args.seed, args.data_dir)
    opt = sgd(s.model, s.job, args.lr)
    slowdown, started = Slowdown.parse(args.slowdowns[0]), time.monotonic()
    snaps = Snapshots(args.snapshots, args.snapshot_s)
    steps = 0
    while time.time() < args.deadline:
        snaps.maybe(s.model, steps * args.batch)
        opt.zero_grad(set_to_none=False)
        slowed_step(s, args.batch, slowdown, started, lambda loss: torch.autograd.backward(loss))
        opt.step()
        steps += 1
    snaps.maybe(s.model, steps * args.batch, force=True)


def train_hivemind(args: argparse.Namespace) -> None:
    import hivemind

    rank = args.rank
    s = setup(rank, args.seed, args.data_dir)
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        tmp = args.peers_file.with_suffix(".tmp")
        tmp.write_text("\n".join(str(a) for a in dht.get_visible_maddrs()))
        os.replace(tmp, args.peers_file)
    else:
        deadline = time.monotonic() + PEERS_FILE_WAIT_S
        while not args.peers_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"peer {rank}: no {args.peers_file} from peer 0 in {PEERS_FILE_WAIT_S:.0f} s")
            time.sleep(0.1)
        dht = hivemind.DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=args.peers_file.read_text().split()
        )
    opt: Any = hivemind.Optimizer(
        dht=dht,
        run_id=f"peers-{args.peers_file.stem}",
        batch_size_per_step=args.batch,
        target_batch_size=args.target_batch,
        optimizer=sgd(s.model, s.job, args.lr),
        use_local_updates=args.local_updates,
        matchmaking_time=3.0,
        averaging_timeout=10.0,
        verbose=False,
    )
    if rank > 0:
        opt.load_state_from_peers()
    slowdown, started = Slowdown.parse(args.slowdowns[rank]), time.monotonic()
    snaps = Snapshots(args.snapshots if rank == 0 else None, args.snapshot_s)
    while time.time() < args.deadline:
        snaps.maybe(s.model, opt.local_epoch * args.target_batch)
        opt.zero_grad()
        slowed_step(s, args.batch, slowdown, started, lambda loss: torch.autograd.backward(loss))
        opt.step()
    snaps.maybe(s.model, opt.local_epoch * args.target_batch, force=True)
    opt.shutdown()
    dht.shutdown()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--slowdowns", nargs="+", default=["1"], help="one slowdown per worker, by rank")
    p.add_argument("--batch", type=int, default=48, help="samples per step of one worker")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, required=True, help="stop training at this time.time()")
    p.add_argument("--snapshots", type=Path, help="worker 0 saves the model here")
    p.add_argument("--snapshot-s", type=float, default=3.0)
    p.add_argument("--data-dir", default="")
    p.add_argument("--rank", type=int, default=0, help="hivemind: this peer's index")
    p.add_argument("--peers-file", type=Path, help="hivemind: where peer 0 writes its address for the others")
    p.add_argument("--target-batch", type=int, default=10000, help="hivemind: samples per collaborative step")
    p.add_argument("--local-updates", action="store_true", help="hivemind: step locally, average in the background")
    args = p.parse_args(argv)
    if args.system == "hivemind" and args.peers_file is None:
        p.error("--system hivemind needs --peers-file")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    {"ddp": train_ddp, "alone": train_alone, "hivemind": train_hivemind}[args.system](args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
