r"""`--protocol auto --batch-policy auto` beside the best method of each regime file, asgd + fixed and the previous
default (asgd + auto), side by side in one run of the same code: time to 80% per seed, and what auto switched to
and when (bench/RESULTS.md 24).

Each method runs as the regime study runs it (`bench/tuned_study.py`'s `sim_config`: the file's workers, global
batch and budget, momentum 0), at its tuned step size (TUNED_LRS["regimes"]; auto and asgd + auto at `--lr-auto`
and asgd + fixed's), stopped at the target.

    python -m bench.auto_default --seeds 0 1 2 --jobs 2 --out DIR
    python -m bench.auto_default --files ps_bound64 --seeds 0 1 --jobs 2 --out DIR \
        --methods "auto (protocol and policy)" local+dynamic
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.parallel_runs import run_parallel
from bench.simulate import simulate
from bench.tuned_study import METHODS, REGIME_BUDGET_S, REGIME_METHODS, TUNED_LRS, Method, Run, regimes, sim_config
from dynabatch.common.tasks.data import load_dataset

AUTO = "auto (protocol and policy)"
DEFAULT = "asgd+auto (the previous default)"
OWN: dict[str, Method] = {AUTO: Method(AUTO, "auto", "auto"), DEFAULT: Method(DEFAULT, "asgd", "auto")}
BEST = {
    "mixed_gpus16": "ringmaster+fixed",
    "mixed_links16": "ringmaster+fixed",
    "ps_bound64": "local+dynamic",
    "cpu_gpu8": "local+dynamic",
}
"""The best simulated method on each file (bench/RESULTS.md 19), which `choose` picks on the file itself."""
TARGET = 0.8


def _run(item: tuple[str, str, float, int]) -> tuple[tuple[str, str, float, int], dict[str, Any]]:
    """One run: (file, method, lr, seed) -> time to TARGET (None: not in the budget), accuracy, auto's choices."""
    METHODS.update(OWN)
    name, method, lr, seed = item
    profile = next(p for p in regimes(REGIME_METHODS, (seed,), (seed,)) if p.profile == name)
    cfg = sim_config(Run(profile, method, lr, seed, True))
    r = simulate(cfg, load_dataset(profile.dataset))
    return item, {
        "t": r.time_to.get(f"{TARGET:.2f}"),
        "acc": r.final_test_acc,
        "switched_to": r.switched_to,
        "choices": [(round(t, 1), c) for t, c in r.auto_choices],
        "samples_per_s": r.samples_per_s,
    }


def plan(seeds: list[int], lr_auto: float) -> list[tuple[str, str, float, int]]:
    """Every file's four methods at every seed, each at its step size."""
    lrs = TUNED_LRS["regimes"]
    methods = {AUTO: lr_auto, DEFAULT: lrs["asgd+fixed"], "asgd+fixed": lrs["asgd+fixed"]}
    return [
        (name, method, lr, seed)
        for name in REGIME_BUDGET_S
        for method, lr in {**methods, BEST[name]: lrs[BEST[name]]}.items()
        for seed in seeds
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """Per file and method: time to TARGET per seed, the median, and the median against the fastest median there
    (a method that reached the target in fewer than half its seeds has none)."""
    by: dict[tuple[str, str], dict[int, float | None]] = {}
    for r in rows:
        by.setdefault((r["file"], r["method"]), {})[r["seed"]] = r["t"]
    out = ["| file | method | time to 80% by seed (s) | median | / fastest |", "|---|---|---|---:|---:|"]
    for name in REGIME_BUDGET_S:
        best = min((m for (f, _), t in by.items() if f == name and (m := _median(t)) is not None), default=None)
        for (file, method), times in by.items():
            if file != name:
                continue
            med = _median(times)
            cells = ", ".join("–" if t is None else f"{t:g}" for _, t in sorted(times.items()))
            ratio = f"{med / best:.2f}x" if med is not None and best else "–"
            out.append(f"| {name} | {method} | {cells} | {'–' if med is None else f'{med:g}'} | {ratio} |")
    return "\n".join(out)


def _median(times: dict[int, float | None]) -> float | None:
    """The median over seeds, a run that never reached the target counting as the slowest (None: half never)."""
    values = sorted((float("inf") if t is None else t) for t in times.values())
    if not values:
        return None
    med = statistics.median(values)
    return None if med == float("inf") else med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auto_default", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lr-auto", type=float, default=0.4, help="auto's --lr (under the delay step)")
    p.add_argument("--files", nargs="+", default=list(REGIME_BUDGET_S), choices=list(REGIME_BUDGET_S))
    p.add_argument("--methods", nargs="+", help="only these methods (default: all four)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "auto_default.jsonl"
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    have = {(r["file"], r["method"], r["lr"], r["seed"]) for r in done}
    todo = [
        i
        for i in plan(args.seeds, args.lr_auto)
        if i[0] in args.files and (not args.methods or i[1] in args.methods) and i not in have
    ]
    with path.open("a") as f:
        for (name, method, lr, seed), r in run_parallel(
            _run, todo, args.jobs, lambda i, r: f"{i[0]} {i[1]} lr {i[2]} seed {i[3]}: {r['t']}", print
        ):
            row = {"file": name, "method": method, "lr": lr, "seed": seed, **r}
            done.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
    print(table(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
