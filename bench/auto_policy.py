"""`--batch-policy auto` beside `fixed` and `dynamic` on one emulated mixed-device cluster (issue 37): real
`dynabatch run`s of the same budget, in interleaved rounds (every configuration once, then again with the next
seed), so that a slow patch of a shared machine hits each alike.

    python -m bench.auto_policy --out DIR [--rounds 2] [--budget-s 20]

Prints one row per configuration (mean over the rounds) and the policy auto ran at the end of each of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench import convergence
from bench.convergence import RunResult, Settings, run_name

SCENARIO = "mixed_devices"
CONFIGS = (("ssgd", "fixed"), ("ssgd", "dynamic"), ("ssgd", "auto"), ("asgd", "fixed"), ("asgd", "auto"))
FLAGS = ("--model", "mlp", "--no-plots")


def auto_ran(out: Path, r: RunResult) -> str:
    """The policy auto ran at the end of run `r` ("" for another policy), from its summary."""
    summary = json.loads((out / run_name(SCENARIO, r.protocol, r.policy, r.seed) / "summary.json").read_text())
    return summary.get("auto_policy") or ""


def table(results: list[RunResult], out: Path) -> str:
    """A markdown table: each configuration's mean figures over its runs and what auto ran."""
    lines = [
        "| configuration | runs | test acc. at budget | time to 85% | samples/s | auto ran |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for stats in convergence.aggregate(results):
        runs = [r for r in results if (r.protocol, r.policy) == (stats.protocol, stats.policy)]
        ran = ", ".join(auto_ran(out, r) for r in runs if r.ok) if stats.policy == "auto" else ""
        reached = stats.time_to.get("0.85")
        to_85 = "never" if reached is None else f"{reached:.1f} s ({stats.reached['0.85']} reached)"
        lines.append(
            f"| {stats.label} | {stats.ok_runs}/{stats.runs} | {100 * (stats.final_test_acc or 0):.2f}% | "
            f"{to_85} | {stats.samples_per_s or 0:,.0f} | {ran} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2, help="seeds 0..rounds-1, every configuration in each")
    p.add_argument("--budget-s", type=float, default=20.0)
    p.add_argument("--data-dir", default="")
    args = p.parse_args(argv)
    settings = Settings(CONFIGS, tuple(range(args.rounds)), args.budget_s, eval_interval_s=2.0, flags=FLAGS)
    print(f"load before: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    results = convergence.run_scenario(SCENARIO, settings, args.out, args.data_dir, lambda s: print(s, file=sys.stderr))
    print(f"load after: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print(table(results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
