"""The simulator against a real run of the same shape on this machine: samples/s, staleness and batches.

1. The machine's own step curve for the model: forward and backward timed in this process (CPU time, as the real
   worker's slowdown counts it) at two batch sizes, fitted as a + c b.
2. A real `dynabatch run`: the workers at the given `--slowdowns` (F or F:A, common/slowdown.py) and
   `--max-batches`, the protocol and batch policy, the MLP on the synthetic set, for `--budget-s` of training.
3. The simulator (bench/simulate.py) with the same workers, the machine's curve, and a transfer time (`comm_s`)
   taken from the real run (its workers' mean pull and push per step: on loopback a transfer is not what the
   shape is about, and the simulator's own links are checked against their formula in tests/test_cluster_model.py).
4. Each figure as simulated / real, and whether it is within the tolerance (10%).

On a machine shared with other jobs the real steps are longer than the curve measured alone says (contention),
so a miss says as much about the machine's load as about the simulator: the script prints the real run's compute
time per step beside the curve's prediction, so the reader can tell which.

    python -m bench.validate_sim --slowdowns 1:0.02 2 4:0.01 --max-batches 0 24 0 --protocol asgd \\
        --policy dynamic --budget-s 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.simulate import SimConfig, SimResult, WorkerSpec, simulate
from dynabatch.cluster.launcher import command_line
from dynabatch.cluster.report import read_timeline
from dynabatch.common.tasks.data import NUM_CLASSES, input_shape, load_dataset, make_batch
from dynabatch.common.tasks.models import build_model

DATASET, MODEL = "synthetic", "mlp"
TOLERANCE = 0.10


def machine_curve(batches: tuple[int, int] = (16, 128), steps: int = 15) -> tuple[float, float]:
    """This machine's forward-and-backward seconds (CPU time, one thread) as a + c b: the line through the median of
    `steps` timed steps at each of two batch sizes."""
    torch.set_num_threads(1)
    data = load_dataset(DATASET)
    model = build_model(MODEL, input_shape(DATASET), NUM_CLASSES, 0)
    medians = []
    for b in batches:
        x, y = make_batch(data, torch.arange(b), train=True)
        times = []
        for _ in range(steps + 1):
            start = time.thread_time()
            model.zero_grad(set_to_none=True)
            torch.autograd.backward(F.cross_entropy(model(x), y))  # Tensor.backward is untyped in torch
            times.append(time.thread_time() - start)
        medians.append(statistics.median(times[1:]))
    per_sample = (medians[1] - medians[0]) / (batches[1] - batches[0])
    fixed = medians[0] - per_sample * batches[0]
    if per_sample <= 0 or fixed < 0:
        raise RuntimeError(
            f"the step times {medians} at batches {batches} are not a fixed plus a per-sample cost: a busy machine?"
        )
    return fixed, per_sample


@dataclass(frozen=True)
class Shape:
    """The cluster both runs take."""

    slowdowns: tuple[str, ...]
    max_batches: tuple[int, ...]
    protocol: str
    policy: str
    global_batch: int
    budget_s: float
    seed: int = 0
    lr: float = 0.05


def real_run(shape: Shape, out: Path) -> tuple[dict[str, Any], list[float]]:
    """One `dynabatch run` of `shape`: its summary, and each worker's mean transfer time (a pull or a push) after
    the first fifth of the run, by its index."""
    name = "real"
    cmd = command_line(
        "run",
        [
            "--workers",
            str(len(shape.slowdowns)),
            "--slowdowns",
            *shape.slowdowns,
            "--max-batches",
            *map(str, shape.max_batches),
            "--protocol",
            shape.protocol,
            "--batch-policy",
            shape.policy,
            "--seed",
            str(shape.seed),
            "--model",
            MODEL,
            "--dataset",
            DATASET,
            "--global-batch",
            str(shape.global_batch),
            "--lr",
            str(shape.lr),
            "--epochs",
            "1000",
            "--time-budget-s",
            str(shape.budget_s),
            "--eval-interval-s",
            str(max(2.0, shape.budget_s / 4)),
            "--out",
            str(out),
            "--name",
            name,
            "--no-plots",
            "--progress-s",
            "30",
            "--timeout-s",
            str(shape.budget_s + 240),
        ],
    )
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    summary_path = out / name / "summary.json"
    if done.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"dynabatch run exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    timeline = read_timeline(out / name / "timeline.json")
    settled = [w for s in timeline[len(timeline) // 5 :] for w in s.workers.values() if w.steps]
    comm = []
    for i in range(len(shape.slowdowns)):
        rows = [w for w in settled if w.name == f"worker{i}"]
        comm.append(statistics.fmean((w.pull_s + w.push_s) / 2 for w in rows) if rows else 0.0)
    return json.loads(summary_path.read_text()), comm


def simulated(shape: Shape, curve: tuple[float, float], comm_s: list[float]) -> SimResult:
    """`shape` in the simulator: each worker's transfer is its real one (`link` times the fastest's)."""
    base = max(1e-6, min(comm_s))
    workers = tuple(
        WorkerSpec(s, max_batch=m, link=max(1e-6, c) / base)
        for s, m, c in zip(shape.slowdowns, shape.max_batches, comm_s, strict=True)
    )
    cfg = SimConfig(
        shape.protocol,
        shape.policy,
        workers,
        seed=shape.seed,
        budget_s=shape.budget_s,
        global_batch=shape.global_batch,
        model=MODEL,
        dataset=DATASET,
        fixed_s=curve[0],
        per_sample_s=curve[1],
        comm_s=base,
        eval_every_s=max(2.0, shape.budget_s / 4),
        eval_size=500,
        job={"lr": shape.lr},
    )
    return simulate(cfg)


def compare(real: dict[str, Any], sim: SimResult) -> list[tuple[str, float | None, float | None, bool | None]]:
    """(figure, real, simulated, within tolerance) for samples/s, staleness and each worker's final batch; the
    real run's workers are named worker0.., the simulated ones sim0.., in the same order."""

    def row(name: str, r: float | None, s: float | None) -> tuple[str, float | None, float | None, bool | None]:
        ok = None if r is None or s is None else abs(s - r) <= TOLERANCE * max(abs(r), 1e-9)
        return name, r, s, ok

    rows = [
        row("samples/s", real["samples_per_s"], sim.samples_per_s),
        row("staleness mean", real["staleness_mean"], sim.staleness_mean),
    ]
    by_name = {w["name"]: w for w in real["workers"].values()}
    for i in range(len(sim.worker_batches)):
        w = by_name.get(f"worker{i}")
        rows.append(row(f"worker{i} batch", w["final_batch"] if w else None, sim.worker_batches.get(f"sim{i}")))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.validate_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--slowdowns", nargs="+", default=["1:0.02", "2", "4:0.01"])
    p.add_argument("--max-batches", nargs="+", type=int, default=[0])
    p.add_argument("--protocol", default="asgd")
    p.add_argument("--policy", default="dynamic")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="folder for the real run (default: a temporary one)")
    args = p.parse_args(argv)
    caps = args.max_batches * len(args.slowdowns) if len(args.max_batches) == 1 else args.max_batches
    shape = Shape(
        tuple(args.slowdowns), tuple(caps), args.protocol, args.policy, args.global_batch, args.budget_s, args.seed
    )
    curve = machine_curve()
    print(f"this machine's step (CPU, one thread): {1000 * curve[0]:.2f} ms + {1000 * curve[1]:.4f} ms per sample")
    with tempfile.TemporaryDirectory() as tmp:
        real, comm = real_run(shape, Path(args.out or tmp))
    sim = simulated(shape, curve, comm)
    print(f"transfers from the real run (a pull or push, by worker): {', '.join(f'{1000 * c:.2f} ms' for c in comm)}")
    for w in sorted(real["workers"].values(), key=lambda w: w["name"]):
        print(
            f"{w['name']}: real compute {w['compute_samples_per_s'] or 0:.0f} samples/s, "
            f"mean step {1000 * (w['mean_step_s_after_warmup'] or 0):.1f} ms at batch {w['final_batch']}"
        )
    print("| figure | real | simulated | within 10% |")
    print("| --- | --- | --- | --- |")
    rows = compare(real, sim)
    for name, r, s, ok in rows:
        shown = ["-" if v is None else f"{v:.2f}" for v in (r, s)]
        print(f"| {name} | {shown[0]} | {shown[1]} | {'-' if ok is None else 'yes' if ok else 'no'} |")
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
