"""Fingerprints of seeded simulator runs, to show that a change to the simulator (its structure, or a new cost
model beside the old one) changes none of its decisions.

Each run is printed with a hash of its accuracy curve, samples, staleness counts, final batches and each worker's
samples: a change that must not alter behaviour prints the same lines before and after.

    python -m bench.simulate_hashes                   # twelve runs: every worker loop, both batch policies
    python -m bench.simulate_hashes --every-profile   # five configurations on every built-in profile (synthetic)
    python -m bench.simulate_hashes > before.txt      # on the old commit; then on the new one:
    python -m bench.simulate_hashes | diff before.txt -
"""

from __future__ import annotations

import argparse
import hashlib
import json

from bench.simulate import PROFILES, SimConfig, SimResult, simulate
from dynabatch.common.tasks.data import load_dataset

RUNS: tuple[tuple[str, str, str, int], ...] = (
    ("asgd", "dynamic", "bench4", 1),
    ("asgd", "fixed", "churn16", 2),
    ("ssgd", "dynamic", "bench4", 1),
    ("ssgd", "fixed", "churn16", 3),
    ("softsync", "fixed", "bench4", 1),
    ("ssp", "dynamic", "bench4", 4),
    ("local", "dynamic", "bench4", 1),
    ("local", "fixed", "churn16", 5),
    ("msd", "dynamic", "bench4", 1),
    ("msd", "fixed", "churn16", 6),
    ("rennala", "dynamic", "bench4", 1),
    ("ringmaster", "fixed", "churn16", 7),
)
"""(protocol, batch policy, profile, seed): every worker loop, both policies, a static and a changing profile."""

PROFILE_CONFIGS = (
    ("asgd", "fixed"),
    ("asgd", "dynamic"),
    ("ssgd", "dynamic"),
    ("local", "dynamic"),
    ("msd", "dynamic"),
)
"""What `--every-profile` runs on each built-in profile: short runs on synthetic data, seconds of CPU each."""


def fingerprint(r: SimResult) -> str:
    """A hash of what a run decided: its curve, samples, staleness and batches."""
    figures = {
        "curve": r.curve,
        "samples": r.samples,
        "staleness": r.staleness_counts,
        "batches": r.batches,
        "worker_samples": r.worker_samples,
    }
    return hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest()[:16]


def _every_loop(budget_s: float) -> None:
    data = load_dataset("fashion-mnist")
    for protocol, policy, profile, seed in RUNS:
        workers = PROFILES[profile]()
        cfg = SimConfig(protocol, policy, workers, seed=seed, budget_s=budget_s, global_batch=16 * len(workers))
        r = simulate(cfg, data)
        print(
            f"{protocol:10} {policy:8} {profile:8} seed {seed}: {r.samples:6d} samples, "
            f"acc {r.final_test_acc:.4f}, {fingerprint(r)}",
            flush=True,
        )


def _every_profile(budget_s: float, seed: int) -> None:
    data = load_dataset("synthetic")
    for name in sorted(PROFILES):
        workers = PROFILES[name]()
        for protocol, policy in PROFILE_CONFIGS:
            cfg = SimConfig(
                protocol,
                policy,
                workers,
                seed=seed,
                budget_s=budget_s,
                global_batch=16 * len(workers),
                dataset="synthetic",
                eval_every_s=0.1,
                eval_size=200,
            )
            print(f"{name} {protocol}+{policy} {fingerprint(simulate(cfg, data))}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.simulate_hashes", allow_abbrev=False, description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--every-profile",
        action="store_true",
        help="five configurations on every built-in profile instead of the twelve runs",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="virtual seconds per run (default 3, or 0.3 with --every-profile)"
    )
    p.add_argument("--seed", type=int, default=3, help="the seed of --every-profile's runs")
    args = p.parse_args(argv)
    if args.every_profile:
        _every_profile(0.3 if args.budget_s is None else args.budget_s, args.seed)
    else:
        _every_loop(3.0 if args.budget_s is None else args.budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
