"""The wire's schedule in the simulator: `--chunk-schedule fixed` against `scheduled` on cluster files.

Each configuration (a cluster file, its shards, a protocol) runs fixed and scheduled on the same seeds, the two
interleaved per seed in ABBA order, each at the step size given for its protocol; a run is a function of its
settings and seed (virtual time), so the order only keeps the method's habit. The shards serve waiting requests by
the scheduler's rank, a push costs its messages and bytes within its credit (bench/cluster_model.py), and the
simulated heartbeats report the bytes each step moved, so the scheduler's own `WireSchedule` plans each worker.
Reports samples/s per seed, their mean ratio, the median time to `--target` test accuracy, and the plans reached.

    python -m bench.simulate_wire --profiles bench/profiles/ps_bound64.json:1 bench/profiles/ps_bound64.json:4 \\
        bench/profiles/mixed_links16.json --protocols ssgd asgd --seeds 0 1 2 --budget-s 60 --target 0.5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from typing import Any

from bench.profile_file import read_profile
from bench.simulate import SimConfig, SimResult, simulate
from dynabatch.common.tasks.data import load_dataset

SCHEDULES = ("fixed", "scheduled")
LRS = {"asgd": 0.02, "ssgd": 0.4}  # the regime study's tuned step sizes on these files (bench/RESULTS.md 14)


def time_to(r: SimResult, target: float) -> float | None:
    """The first virtual second at which the run's test accuracy reached `target` (None: never)."""
    return next((t for t, _, acc in r.curve if acc >= target), None)


def run_pair(path: str, shards: int, protocol: str, seeds: list[int], budget_s: float, lr: float) -> dict[str, Any]:
    """Fixed and scheduled on every seed of one configuration, interleaved per seed."""
    profile = read_profile(path)
    data = load_dataset("fashion-mnist")
    out: dict[str, list[SimResult]] = {s: [] for s in SCHEDULES}
    for i, seed in enumerate(seeds):
        for schedule in SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]:
            cfg = SimConfig(
                protocol,
                "fixed",
                profile.workers,
                seed=seed,
                budget_s=budget_s,
                global_batch=profile.global_batch or 16 * len(profile.workers),
                job={"lr": lr, "chunk_schedule": schedule},
                **{**profile.sim_settings(), "shards": shards or profile.sim_settings()["shards"]},
            )
            out[schedule].append(simulate(cfg, data))
    return {"name": profile.name, "shards": shards or profile.sim_settings()["shards"], "runs": out}


def row(result: dict[str, Any], protocol: str, target: float) -> str:
    """One markdown row: samples/s per seed each way, the ratio of the means, median time to target, plans."""
    runs = result["runs"]
    sps = {s: [r.samples_per_s for r in runs[s]] for s in SCHEDULES}
    ratio = statistics.mean(sps["scheduled"]) / statistics.mean(sps["fixed"])

    def reached(s: str) -> str:
        times = [time_to(r, target) for r in runs[s]]
        got = [t for t in times if t is not None]
        if len(got) < len(times):
            return f"{statistics.median(got):.0f} s ({len(got)}/{len(times)})" if got else "never"
        return f"{statistics.median(got):.0f} s"

    plans = Counter(p for r in runs["scheduled"] for p in r.worker_wire.values())
    shown = ", ".join(f"{g} x {c >> 20} MiB: {n}" for (g, c), n in plans.most_common(3))
    return (
        f"| {result['name']} | {result['shards']} | {protocol} | {', '.join(f'{v:,.0f}' for v in sps['fixed'])} | "
        f"{', '.join(f'{v:,.0f}' for v in sps['scheduled'])} | {ratio:.3f} | {reached('fixed')} | "
        f"{reached('scheduled')} | {shown} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate_wire", description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", nargs="+", required=True, help="FILE.json or FILE.json:SHARDS")
    p.add_argument("--protocols", nargs="+", default=["ssgd", "asgd"], choices=sorted(LRS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--budget-s", type=float, default=60.0, help="virtual seconds per run")
    p.add_argument("--target", type=float, default=0.5, help="test accuracy whose time is reported")
    args = p.parse_args(argv)
    print(
        f"| profile | shards | protocol | fixed samples/s | scheduled samples/s | scheduled / fixed | "
        f"fixed: time to {args.target:.0%} | scheduled: time to {args.target:.0%} | plans (chunks x credit: workers) |"
    )
    print("|---|---:|---|---|---|---:|---|---|---|")
    for spec in args.profiles:
        path, _, shards = spec.partition(":")
        for protocol in args.protocols:
            result = run_pair(path, int(shards or 0), protocol, args.seeds, args.budget_s, LRS[protocol])
            print(row(result, protocol, args.target), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
