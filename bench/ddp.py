"""Synchronous step time: dynabatch ssgd against torch.distributed DDP (gloo) on the same workers.

Both sides train the job's CNN on Fashion-MNIST with the same number of
homogeneous worker processes, one torch thread each, and the same per-worker
batch (the global batch split evenly). dynabatch: `dynabatch run --protocol ssgd
--batch-policy fixed`, its step being pull + compute + push + the wait for the
round. DDP: one process per rank, all-reduce in backward, a local SGD step. The
two alternate, `rounds` times each, and the figure is the ratio of mean step
times after warm-up: DDP's over ours, so above 1 means dynabatch is faster.

Run one DDP rank by hand with `python -m bench.ddp --rank R --world N --init tcp://127.0.0.1:PORT`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dynabatch.cluster.launcher import command_line
from dynabatch.cluster.ports import free_port
from dynabatch.common.base_lr import base_lr

if TYPE_CHECKING:
    from bench.peer_train import Setup

WARMUP_FRACTION = 0.2  # as `dynabatch run`'s summary, the first fifth of the steps is left out


@dataclass(frozen=True)
class Settings:
    workers: int
    duration_s: float
    rounds: int
    global_batch: int = 192


@dataclass
class RoundResult:
    dynabatch_step_s: float | None
    ddp_step_s: float | None


def rank_main(argv: list[str]) -> int:
    """One DDP rank: train for `--duration-s`, print the mean step time after warm-up as JSON (rank 0)."""
    from bench.peer_train import gloo_group, setup

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--data-dir", default="")
    args = p.parse_args(argv)
    s = setup(args.rank, 0, args.data_dir)  # the job's model and worker `rank`'s data order, one torch thread
    times: list[float] = []
    with gloo_group(init_method=args.init, rank=args.rank, world_size=args.world):
        _timed_steps(s, args.batch, args.duration_s, times)
    kept = times[int(WARMUP_FRACTION * len(times)) :]
    if args.rank == 0:
        print(json.dumps({"mean_step_s": statistics.fmean(kept), "steps": len(times)}))
    return 0


def _timed_steps(s: Setup, batch: int, duration_s: float, times: list[float]) -> None:
    """DDP's steps of `batch` samples for `duration_s`, each one's seconds appended to `times`."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from bench.peer_train import all_done, sgd
    from dynabatch.common.tasks.data import make_batch

    model = DistributedDataParallel(s.model)
    opt = sgd(model, s.job, base_lr(s.job))
    end = time.monotonic() + duration_s
    while not all_done(time.monotonic() >= end):
        x, y = make_batch(s.data, s.order.take(batch), True, s.generator)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.autograd.backward(F.cross_entropy(model(x), y))  # Tensor.backward is untyped in torch
        opt.step()
        times.append(time.perf_counter() - start)


def ddp_step(settings: Settings, port: int, data_dir: str, log_dir: Path) -> float | None:
    """Mean DDP step time over a run of `settings.workers` ranks (None if it failed)."""
    batch = settings.global_batch // settings.workers
    procs = []
    for rank in range(settings.workers):
        cmd = [
            sys.executable,
            "-m",
            "bench.ddp",
            "--rank",
            str(rank),
            "--world",
            str(settings.workers),
            "--init",
            f"tcp://127.0.0.1:{port}",
            "--batch",
            str(batch),
            "--duration-s",
            str(settings.duration_s),
        ]
        if data_dir:
            cmd += ["--data-dir", data_dir]
        with open(log_dir / f"ddp-rank{rank}.log", "ab") as err:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL))
    out = procs[0].communicate(timeout=settings.duration_s + 180)[0]
    for proc in procs[1:]:
        proc.wait(timeout=60)
    if any(p.returncode != 0 for p in procs) or not out.strip():
        return None
    mean_step_s: float = json.loads(out.decode().strip().splitlines()[-1])["mean_step_s"]
    return mean_step_s


def dynabatch_step(settings: Settings, out: Path, name: str, data_dir: str) -> float | None:
    """Mean step time of the workers of an ssgd + fixed `dynabatch run` (None if it failed)."""
    cmd = command_line(
        "run",
        [
            "--workers",
            str(settings.workers),
            "--slowdowns",
            "1",
            "--protocol",
            "ssgd",
            "--batch-policy",
            "fixed",
            "--global-batch",
            str(settings.global_batch),
            "--no-evaluator",
            "--epochs",
            "1000",
            "--time-budget-s",
            str(settings.duration_s),
            "--out",
            str(out),
            "--name",
            name,
            "--progress-s",
            "30",
            "--timeout-s",
            str(settings.duration_s + 180),
        ],
    )
    if data_dir:
        cmd += ["--data-dir", data_dir]
    shutil.rmtree(out / name, ignore_errors=True)  # a run left by an earlier benchmark is replaced, never resumed
    with open(out / f"{name}.log", "wb") as log_file:
        subprocess.call(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    path = out / name / "summary.json"
    if not path.exists():
        return None
    steps = [
        w["mean_step_s_after_warmup"]
        for w in json.loads(path.read_text()).get("workers", {}).values()
        if w["mean_step_s_after_warmup"]
    ]
    return statistics.fmean(steps) if steps else None


def compare(settings: Settings, out: Path, data_dir: str, progress: Callable[[str], None]) -> list[RoundResult]:
    """dynabatch and DDP in alternation, `settings.rounds` times."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for r in range(settings.rounds):
        dyn = dynabatch_step(settings, out, f"ssgd-round{r}", data_dir)
        ddp = ddp_step(settings, free_port(), data_dir, out)
        results.append(RoundResult(dyn, ddp))
        progress(
            f"[ddp {r + 1}/{settings.rounds}] {settings.workers} workers: dynabatch ssgd step "
            f"{_ms(dyn)}, DDP/gloo step {_ms(ddp)}"
        )
    return results


def summary(settings: Settings, rounds: list[RoundResult]) -> dict[str, object]:
    """Means over rounds and the speed ratio (DDP step / dynabatch step)."""
    dyn = [r.dynabatch_step_s for r in rounds if r.dynabatch_step_s]
    ddp = [r.ddp_step_s for r in rounds if r.ddp_step_s]
    ratio = statistics.fmean(ddp) / statistics.fmean(dyn) if dyn and ddp else None
    return {
        "settings": asdict(settings),
        "rounds": [asdict(r) for r in rounds],
        "dynabatch_step_s": statistics.fmean(dyn) if dyn else None,
        "ddp_step_s": statistics.fmean(ddp) if ddp else None,
        "speed_ratio": ratio,
    }


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds else "failed"


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
