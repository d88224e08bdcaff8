"""A fingerprint of the simulator's seeded runs on every built-in profile: a change that must not alter today's
results (a new cost model beside the old one, a refactoring) keeps every line of its output the same.

Each line hashes one short run's curve, samples and final batches (synthetic data, so it costs seconds of CPU).
Run it before and after a change and compare:

    python -m bench.sim_fingerprint > before.txt   # on the old commit
    python -m bench.sim_fingerprint | diff before.txt -
"""

from __future__ import annotations

import argparse
import hashlib
import json

from bench.simulate import PROFILES, SimConfig, SimResult, simulate
from dynabatch.common.data import load_dataset

CONFIGS = (("asgd", "fixed"), ("asgd", "dynamic"), ("ssgd", "dynamic"), ("local", "dynamic"), ("msd", "dynamic"))


def fingerprint(r: SimResult) -> str:
    """A short hash of what a run produced: its accuracy curve, samples and the batches at the end."""
    text = json.dumps({"curve": r.curve, "samples": r.samples, "batches": r.batches, "counts": r.staleness_counts},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_fingerprint", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=0.3, help="virtual seconds per run")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)
    data = load_dataset("synthetic")
    for name in sorted(PROFILES):
        workers = PROFILES[name]()
        for protocol, policy in CONFIGS:
            cfg = SimConfig(protocol, policy, workers, seed=args.seed, budget_s=args.budget_s,
                            global_batch=16 * len(workers), dataset="synthetic", eval_every_s=0.1, eval_size=200)
            print(f"{name} {protocol}+{policy} {fingerprint(simulate(cfg, data))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
