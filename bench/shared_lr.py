"""Whether one `--lr` serves a job whichever protocol it runs: each method's time to the target at every step size
its tuning tried, against its own best, on each cluster.

A protocol chosen at run time (`--protocol auto`) takes the job's one `--lr`; that is safe only if the step size
each protocol is tuned to is about the same. The methods compared step once per B samples (a round's step: ssgd,
msync, Rennala, LB-BSP) or are made to (asgd and Ringmaster under `--staleness-step delay`, lr / max(1, tau)), so
their grids share step sizes; local SGD steps once per B/n samples and is tuned on its own grid, so its step size is
shown beside them, not on the shared one. The figures are the tuning runs' (`bench/tuned_study.py`: each stops at the
target, so its time to it is known), a median over the tuning seeds.

    python -m bench.shared_lr DIR/regimes-cut     # the table from a study's results.json
"""

from __future__ import annotations

import math
import statistics
from typing import Any

SHARED = (
    "asgd+fixed (delay step)",
    "ringmaster+fixed (delay step)",
    "DBS-SGD (delay step)",
    "ssgd+fixed",
    "LB-BSP (ssgd+dynamic)",
    "msync+fixed",
    "rennala+dynamic",
)
"""The methods whose step size is one per B samples, tuned over grids that share step sizes."""
WITHIN = 1.1
"""How far from a method's best a shared step size may leave it and still serve it."""


def times_by_lr(tuning: list[dict[str, Any]], method: str, mark: str) -> dict[float, float]:
    """Median time to `mark` (inf: never, or diverged) over the tuning seeds, per step size `method` was tuned at."""
    from bench.tuned_study import diverged, time_to

    by: dict[float, list[float]] = {}
    for r in tuning:
        if r["method"] == method:
            by.setdefault(r["lr"], []).append(math.inf if diverged(r) else time_to(r, mark))
    return {lr: statistics.median(ts) for lr, ts in sorted(by.items())}


def shared_rows(tuning: list[dict[str, Any]], mark: str, methods: tuple[str, ...] = SHARED) -> list[dict[str, Any]]:
    """Per step size that every method of `methods` with tuning runs was tried at: each method's time there against
    its own best time (its tuned step size's), and the worst of those ratios over the methods that reached the
    target at some step size (one that never did is served by none, and judges none)."""
    times = {m: t for m in methods if (t := times_by_lr(tuning, m, mark))}
    if not times:
        return []
    best = {m: min(t.values()) for m, t in times.items()}
    common = sorted(set.intersection(*(set(t) for t in times.values())))
    rows = []
    for lr in common:
        ratios = {m: t[lr] / best[m] if math.isfinite(best[m]) else math.inf for m, t in times.items()}
        worst = max((r for m, r in ratios.items() if math.isfinite(best[m])), default=math.inf)
        rows.append({"lr": lr, "ratios": ratios, "times": {m: t[lr] for m, t in times.items()}, "worst": worst})
    return rows


def render_shared(name: str, tuning: list[dict[str, Any]], mark: str, chosen: dict[str, float | None]) -> list[str]:
    """The markdown table of `shared_rows` for one cluster, with each method's tuned step size (local SGD's too)."""
    rows = shared_rows(tuning, mark)
    if not rows:
        return []
    methods = list(rows[0]["ratios"])
    tuned = ", ".join(f"{m} {chosen.get(m)}" for m in (*methods, "local+dynamic") if m in chosen)
    if all(not math.isfinite(t) for m in methods for t in times_by_lr(tuning, m, mark).values()):
        return [
            f"{name}: no method stepping once per B samples reached {float(mark):.0%} at any step size in tuning, "
            f"so no step size serves or fails one; their step sizes as chosen by accuracy at the budget: {tuned}",
            "",
        ]
    out = [
        f"{name}: each method's time to {float(mark):.0%} at a shared step size / at its own best (tuning runs); "
        f"tuned: {tuned}",
        "",
        f"| lr | {' | '.join(methods)} | worst | one lr within {WITHIN:g}x of every best |",
        "|---:|" + "---:|" * len(methods) + "---:|---|",
    ]
    for row in rows:
        cells = " | ".join(_cell(row["times"][m], row["ratios"][m]) for m in methods)
        verdict = "yes" if row["worst"] <= WITHIN else "no"
        worst = f"{row['worst']:.2f}x" if math.isfinite(row["worst"]) else "never"
        out.append(f"| {row['lr']:g} | {cells} | {worst} | {verdict} |")
    return [*out, ""]


def _cell(time_s: float, ratio: float) -> str:
    return f"{time_s:.0f} s ({ratio:.2f}x)" if math.isfinite(ratio) else "never"


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    res = json.loads((Path(sys.argv[1]) / "results.json").read_text())
    for name, runs in res["tuning"].items():
        p = res["profiles"][name]
        mine = [r for r in runs if r["seed"] in p["tune_seeds"]]
        print("\n".join(render_shared(name, mine, p["target"], res["chosen"].get(name, {}))))
