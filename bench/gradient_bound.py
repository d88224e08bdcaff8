"""What the gradient bound costs an honest job: the heterogeneous benchmark with the shards' defences on and off.

Each run is bench/convergence.py's real `dynabatch run` (4 honest workers at
slowdowns 1, 1, 2, 4, Fashion-MNIST CNN, one shard) under one configuration
(default asgd+fixed); the variants differ only in the shard's defences against
Byzantine workers (--gradient-bound, --direction-check) and run alternately
within each seed, so that a shared machine's noise hits them alike. Besides the
accuracy and the times to 85% and 88%, it reads from the shard's closing log line
how many honest pushes the bound clipped and how many workers it quarantined
(none should be). Run from the repository root:

    python -m bench.gradient_bound [--configs asgd+fixed] [--seeds 0 1] [--budget-s 60] [--variants on off]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.convergence import RunResult, Settings, parse_configs, run_name, run_one

VARIANTS: dict[str, tuple[str, ...]] = {
    "on": (),  # the defaults: --gradient-bound 4 and --direction-check
    "off": ("--gradient-bound", "0", "--no-direction-check"),
    "bound-only": ("--no-direction-check",),
}
DEFAULT_OUT = Path("bench/results/gradient_bound")
# The shard's closing line (ps/server.py): "the gradient bound (--gradient-bound 4) clipped 3 pushes; 0 workers
# quarantined; direction scores: ..."
CLOSING = re.compile(r"clipped (\d+) pushes; (\d+) workers quarantined")


@dataclass
class VariantRun:
    variant: str
    run: RunResult
    updates: int | None  # the shard's model updates (asgd: one per push taken)
    clipped: int | None  # honest pushes the bound scaled down (None: no closing line found)
    quarantined: int | None


def shard_closing(run_dir: Path) -> tuple[int | None, int | None]:
    """(pushes clipped, workers quarantined) from every shard's closing line in `run_dir`/logs, summed."""
    found = [
        CLOSING.search(line)
        for log in sorted((run_dir / "logs").glob("ps*.log"))
        for line in log.read_text(errors="replace").splitlines()
    ]
    hits = [m for m in found if m]
    if not hits:
        return None, None
    return sum(int(m[1]) for m in hits), sum(int(m[2]) for m in hits)


def run_variant(
    variant: str, protocol: str, policy: str, seed: int, budget_s: float, out: Path, data_dir: str
) -> VariantRun:
    settings = Settings(((protocol, policy),), (seed,), budget_s, flags=VARIANTS[variant])
    (out / variant).mkdir(parents=True, exist_ok=True)
    run = run_one("heterogeneous", protocol, policy, seed, settings, out / variant, data_dir)
    run_dir = out / variant / run_name("heterogeneous", protocol, policy, seed)
    summary = run_dir / "summary.json"
    updates = json.loads(summary.read_text()).get("updates") if summary.exists() else None
    clipped, quarantined = shard_closing(run_dir) if run_dir.exists() else (None, None)
    return VariantRun(variant, run, updates, clipped, quarantined)


def row(v: VariantRun) -> str:
    r = v.run

    def when(mark: str) -> str:
        t = r.time_to.get(mark)
        return f"{t:.0f} s" if t is not None else "–"

    acc = f"{r.final_test_acc * 100:.2f}%" if r.final_test_acc is not None else "–"
    speed = f"{r.samples_per_s:,.0f}" if r.samples_per_s is not None else "–"
    return (
        f"| {r.label} | {v.variant} | {r.seed} | {acc} | {when('0.85')} | {when('0.88')} | {speed} | "
        f"{v.updates} | {v.clipped} | {v.quarantined} |" + ("" if r.ok else f" FAILED: {r.error}")
    )


HEADER = (
    "| configuration | defences | seed | test acc. at budget | time to 85% | time to 88% | samples/s | updates | "
    "pushes clipped | quarantined |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gradient_bound", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--configs", nargs="+", default=["asgd+fixed"], metavar="PROTOCOL+POLICY")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    runs = []
    for seed in args.seeds:
        for protocol, policy in parse_configs(args.configs):
            for variant in args.variants:
                runs.append(run_variant(variant, protocol, policy, seed, args.budget_s, args.out, args.data_dir))
                print(row(runs[-1]), file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps([asdict(v) for v in runs], indent=2))
    print(HEADER)
    for v in runs:
        print(row(v))
    return 0 if all(v.run.ok for v in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
