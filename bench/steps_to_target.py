"""K(B): the steps staleness-free sequential SGD takes to the target at each global batch B, and its fit.

One simulated worker (bench/simulate.py) with no transfer time and a step of exactly one virtual second, so that
every step is computed on the model the last one produced (staleness 0) and virtual seconds count steps: the
real shard's optimizer on the study's model and data (bench/tuned_study.py: the MLP on Fashion-MNIST, momentum
0, target 80% on 1000 test samples). Each B gets its own step size, the grid's best median over the seeds (a rate
whose run missed the target in any seed is not chosen). The steps at the batches are then fitted as
K(B) = K_min (1 + B_noise / B) (common/planning/optimum.py), the calibration of the optimal time T*.

    python -m bench.steps_to_target --jobs 2   # B = 32, 128, 512; 6 step sizes; 2 seeds
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

from bench.parallel_runs import run_parallel
from bench.simulate import SimConfig, WorkerSpec, simulate
from dynabatch.common.planning.optimum import fit_steps_to_target

LRS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32)


def sequential(
    batch: int, lr: float, seed: int, target: float, max_steps: int, every: int, dataset: str
) -> float | None:
    """Steps to `target` of one worker's sequential SGD at `batch` and `lr` (None: not within `max_steps`),
    judged every `every` steps."""
    cfg = SimConfig(
        "asgd",
        "fixed",
        (WorkerSpec(),),
        seed=seed,
        budget_s=float(max_steps),
        global_batch=batch,
        model="mlp",
        dataset=dataset,
        fixed_s=1.0,
        per_sample_s=0.0,
        noise=0.0,
        comm_s=0.0,
        eval_every_s=float(every),
        eval_size=1000,
        job={"lr": lr, "momentum": 0.0, "max_batch": batch},
    )
    r = simulate(cfg)
    return next((samples / batch for _, samples, acc in r.curve if acc >= target), None)


def _run(
    item: tuple[int, float, int], target: float, max_steps: int, every: int, dataset: str
) -> tuple[tuple[int, float, int], float | None]:
    batch, lr, seed = item
    return item, sequential(batch, lr, seed, target, max_steps, every, dataset)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.steps_to_target", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[32, 128, 512])
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--target", type=float, default=0.80)
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--every", type=int, default=10, help="steps between evaluations")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)
    plan = [(b, lr, s) for b in args.batches for lr in args.lrs for s in args.seeds]
    run = partial(_run, target=args.target, max_steps=args.max_steps, every=args.every, dataset=args.dataset)
    steps: dict[tuple[int, float], list[float | None]] = {}
    for (b, lr, _), k in run_parallel(
        run, plan, args.jobs, lambda item, r: f"B={item[0]} lr={item[1]}: {r}", lambda line: print(line, flush=True)
    ):
        steps.setdefault((b, lr), []).append(k)
    print("| B | best lr | steps to target (median over seeds) | other step sizes |")
    print("| --- | --- | --- | --- |")
    best: dict[int, float] = {}
    for b in args.batches:
        every_seed = {lr: [k for k in steps[(b, lr)] if k is not None] for lr in args.lrs}
        reached = {lr: statistics.median(ks) for lr, ks in every_seed.items() if len(ks) == len(args.seeds)}
        others = ", ".join(f"{lr:g}: {f'{reached[lr]:.0f}' if lr in reached else '-'}" for lr in args.lrs)
        if not reached:
            print(f"| {b} | - | not reached in {args.max_steps} | {others} |")
            continue
        lr = min(reached, key=lambda x: reached[x])
        best[b] = reached[lr]
        print(f"| {b} | {lr:g} | {reached[lr]:.0f} | {others} |")
    if len(best) < 2:
        print("fewer than two batch sizes reached the target: no fit")
        return 1
    fit = fit_steps_to_target(list(best), list(best.values()))
    print(
        f"K(B) = {fit.k_min:.1f} (1 + {fit.b_noise:.1f} / B): "
        + ", ".join(f"B={b}: fitted {fit.steps(b):.0f}, measured {k:.0f}" for b, k in best.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
