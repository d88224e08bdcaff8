"""Fingerprints of a fixed set of seeded simulator runs, to show that a change to the simulator's structure
changes none of its decisions.

Each run is printed with a hash of its accuracy curve, samples, staleness counts and final batches: a refactor
that must not change behaviour prints the same lines before and after.

    python -m bench.simulate_hashes
"""

from __future__ import annotations

import argparse
import hashlib
import json

from bench.simulate import PROFILES, SimConfig, SimResult, simulate
from dynabatch.common.data import load_dataset

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


def fingerprint(r: SimResult) -> str:
    """A hash of what a run decided: its curve, samples, staleness and batches."""
    figures = {"curve": r.curve, "samples": r.samples, "staleness": r.staleness_counts, "batches": r.batches,
               "worker_samples": r.worker_samples}
    return hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate_hashes", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=3.0, help="virtual seconds per run")
    args = p.parse_args(argv)
    data = load_dataset("fashion-mnist")
    for protocol, policy, profile, seed in RUNS:
        workers = PROFILES[profile]()
        cfg = SimConfig(protocol, policy, workers, seed=seed, budget_s=args.budget_s,
                        global_batch=16 * len(workers))
        r = simulate(cfg, data)
        print(f"{protocol:10} {policy:8} {profile:8} seed {seed}: {r.samples:6d} samples, "
              f"acc {r.final_test_acc:.4f}, {fingerprint(r)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
