r"""`--protocol auto --batch-policy auto` (the default) beside the best method of each regime file and asgd + fixed
(the default before auto), side by side in one run of the same code: time to 80% per seed, and what auto switched to
and when (bench/RESULTS.md 24).

Each method runs as the regime study runs it (`bench/tuned_study.py`'s `sim_config`: the file's workers, global
batch and budget, momentum 0), stopped at the target (bench/RESULTS.md 26), at the step size tuned for it on that
file. The other methods' were tuned by the regime study (BEST, PREVIOUS; bench/RESULTS.md 20); auto's is tuned here
the same way (`tune_auto`: tuned_study's `tune` on TUNED_IN's tuning seeds, over the grid of the delay-step methods
extended past a winning edge, chosen by `choose_lr`), then run on the report seeds (bench/RESULTS.md 39).
`--lr-auto L` runs auto at L on every file instead, untuned.

    python -m bench.auto_default --seeds 0 1 2 --jobs 2 --out DIR
    python -m bench.auto_default --files ps_bound64 --seeds 0 1 --jobs 2 --out DIR \
        --methods "auto (protocol and policy)" local+dynamic
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.parallel_runs import run_parallel
from bench.plots import plt, save
from bench.tuned_study import (
    REGIME_BUDGET_S,
    REGIME_METHODS,
    STUDIES,
    TUNED_AUTO,
    Profile,
    Results,
    Run,
    diverged,
    reference_s,
    regimes,
    simulate_run,
    time_to,
    tune,
)

AUTO = TUNED_AUTO.name
"""auto as a method of the study, tuned over the delay-step methods' grid (tuned_study's `tuned_auto`)."""
TUNED_IN = "regimes-cut"
"""The study whose tuning chose BEST's and PREVIOUS's step sizes (bench/RESULTS.md 20): auto is tuned on its tuning
seeds, over its grids, past a winning edge as often, by its rule."""
BEST = {
    "mixed_gpus16": {"ringmaster+fixed": 0.04},
    "mixed_links16": {"asgd+efficient": 0.04, "ringmaster+fixed": 0.04},
    "ps_bound64": {"local+dynamic": 0.32, "local+fixed": 0.32},
    "cpu_gpu8": {"local+dynamic": 0.32},
}
"""The fastest method on each file in the regime study with every file tuned (bench/RESULTS.md 20; on ps_bound64 also
local + fixed, the fastest once every row there was tuned alike, section 47), and on mixed_links16 Ringmaster, auto's
earlier pick there, each at its step size tuned on that file."""
PREVIOUS = {"mixed_gpus16": 0.02, "mixed_links16": 0.02, "ps_bound64": 0.005, "cpu_gpu8": 0.08}
"""asgd + fixed's step size tuned on each file (bench/RESULTS.md 20): the previous default's."""
TARGET = 0.8
AIM = 1.1
"""Issue 37's criterion on the regime files: the default within 1.1x of the best method."""


def run_row(profile: Profile, method: str, lr: float, seed: int) -> dict[str, Any]:
    """One run of `method` on `profile` at `lr`, stopped at TARGET: its time to it (None: not in the budget),
    accuracy, whether it diverged (tuned_study's rule), what auto switched to and chose, and its CPU seconds."""
    _, (r, cpu_s) = simulate_run(Run(profile, method, lr, seed, True))
    row = {"final_train_loss": r.final_train_loss, "final_test_acc": r.final_test_acc, "curve": r.curve}
    return {
        "t": r.time_to.get(f"{TARGET:.2f}"),
        "acc": r.final_test_acc,
        "diverged": diverged({**row, "quarantined": r.quarantined}),
        "switched_to": r.switched_to,
        "choices": [(round(t, 1), c) for t, c in r.auto_choices],
        "samples_per_s": r.samples_per_s,
        "cpu_s": cpu_s,
    }


def tuning_profile(name: str, seeds: tuple[int, ...] = (), reached_over: int = 1) -> Profile:
    """The file as TUNED_IN tuned it, with auto its one method, on `seeds` where given instead of TUNED_IN's tuning
    seeds, its time to the target over `reached_over` evaluations."""
    p = next(p for p in STUDIES[TUNED_IN] if p.profile == name)
    return replace(p, methods=(AUTO,), tune_seeds=seeds or p.tune_seeds, reached_over=reached_over)


def tune_auto(
    names: list[str],
    jobs: int,
    out: Path,
    log: Callable[[str], None],
    seeds: tuple[int, ...] = (),
    reached_over: int = 1,
) -> dict[str, float | None]:
    """auto's step size on each file (None: it diverged at every step size tried), tuned as TUNED_IN tuned every
    other method (tuned_study's `tune`; on `seeds` where given; on times over `reached_over` evaluations); the
    tuning runs are kept in out/auto_tuning.json (auto_tuning-over{K}.json for K > 1), so a run stopped early goes
    on from them."""
    path = out / ("auto_tuning.json" if reached_over == 1 else f"auto_tuning-over{reached_over}.json")
    res = Results(**json.loads(path.read_text())) if path.exists() else Results()

    def save() -> None:
        path.write_text(json.dumps(asdict(res)))

    chosen: dict[str, float | None] = {}
    for name in names:
        p = tuning_profile(name, seeds, reached_over)
        log(f"{name}: tuning auto over {p.grid(AUTO)} (grown past a winning edge) on seeds {p.tune_seeds}")
        chosen[name] = tune(p, res, jobs, save, log)[AUTO]
        log(f"{name}: auto's step size {chosen[name]}")
    save()
    log(tuning_table(res.tuning, chosen, seeds, reached_over))
    return chosen


def tuning_table(
    tuning: dict[str, list[dict[str, Any]]],
    chosen: dict[str, float | None],
    seeds: tuple[int, ...] = (),
    reached_over: int = 1,
) -> str:
    """auto's tuning runs on each file (on `tuning_profile`'s seeds): per step size, its time to TARGET and accuracy
    in each tuning seed, whether it diverged in any, and which was chosen."""
    out = [
        f"| file | lr | {time_label(reached_over)} by tuning seed (s) | accuracy | diverged | chosen |",
        "|---|---:|---|---|---|---|",
    ]
    for name, lr in chosen.items():
        runs = [
            r
            for r in tuning.get(name, [])
            if r["method"] == AUTO and r["seed"] in tuning_profile(name, seeds).tune_seeds
        ]
        for step in sorted({r["lr"] for r in runs}):
            at = sorted((r for r in runs if r["lr"] == step), key=lambda r: r["seed"])
            times = ", ".join(f"{t:g}" if (t := time_to(r, f"{TARGET:.2f}")) != float("inf") else "–" for r in at)
            accs = ", ".join(f"{100 * r['final_test_acc']:.1f}%" for r in at)
            gone = "yes" if any(diverged(r) for r in at) else "no"
            out.append(f"| {name} | {step:g} | {times} | {accs} | {gone} | {'**yes**' if step == lr else ''} |")
    return "\n".join(out)


Item = tuple[str, str, float, int, int]
"""One run: (file, method, lr, seed, the evaluations a time to the target is the mean of)."""


def _run(item: Item) -> tuple[Item, dict[str, Any]]:
    """One run -> `run_row`."""
    name, method, lr, seed, reached_over = item
    profile = next(p for p in regimes(REGIME_METHODS, (seed,), (seed,)) if p.profile == name)
    return item, run_row(replace(profile, reached_over=reached_over), method, lr, seed)


def plan(seeds: list[int], lr_auto: dict[str, float | None], reached_over: int = 1) -> list[Item]:
    """Every file's methods at every seed: auto (at `lr_auto`'s step size for the file; not where it has none),
    asgd + fixed (the previous default; asgd + auto ran as it, run for run, in section 20) and the file's fastest,
    each at its step size tuned there."""
    return [
        (name, method, lr, seed, reached_over)
        for name in lr_auto
        for method, lr in {AUTO: lr_auto[name], "asgd+fixed": PREVIOUS[name], **BEST[name]}.items()
        if lr is not None
        for seed in seeds
    ]


def _item(row: dict[str, Any]) -> Item:
    """The run a stored row is (rows stored before `--reached-over` took a time over one evaluation)."""
    return (row["file"], row["method"], row["lr"], row["seed"], row.get("reached_over", 1))


def time_label(reached_over: int) -> str:
    """What a time is: to 80% at the first evaluation, or at the first mean of `reached_over`."""
    return "time to 80%" + (f" (mean of {reached_over} evaluations)" if reached_over > 1 else "")


Runs = dict[tuple[str, str, float], dict[int, dict[str, Any]]]
"""Rows by (file, method, lr), then by seed."""


def _by_method(rows: list[dict[str, Any]], reached_over: int) -> Runs:
    """The rows whose times are over `reached_over` evaluations, by method and seed."""
    by: Runs = {}
    for r in rows:
        if _item(r)[-1] == reached_over:
            by.setdefault((r["file"], r["method"], r["lr"]), {})[r["seed"]] = r
    return by


def _medians(by: Runs, name: str) -> dict[tuple[str, str, float], float | None]:
    """Each method's median time on file `name` (`_median`)."""
    return {k: _median({s: r["t"] for s, r in runs.items()}) for k, runs in by.items() if k[0] == name}


def table(rows: list[dict[str, Any]], reached_over: int = 1) -> str:
    """Per file and method: time to TARGET per seed, the median, the median against the fastest median there and
    against T* (a method that reached the target in fewer than half its seeds has none), and divergences; of the
    rows whose times are over `reached_over` evaluations."""
    by = _by_method(rows, reached_over)
    out = [
        f"| file | method | lr | {time_label(reached_over)} by seed (s) | median | / fastest | / T* | diverged |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for name in REGIME_BUDGET_S:
        star = _t_star(name)
        medians = _medians(by, name)
        best = min((t for t in medians.values() if t is not None), default=None)
        for (file, method, lr), runs in by.items():
            if file != name:
                continue
            med, seeds = medians[file, method, lr], sorted(runs.items())
            cells = ", ".join("–" if r["t"] is None else f"{r['t']:g}" for _, r in seeds)
            ratio = f"{med / best:.2f}x" if med is not None and best else "–"
            to_star = f"{med / star:.2f}x" if med is not None else "–"
            gone = sum(bool(r.get("diverged")) for _, r in seeds)
            out.append(
                f"| {name} | {method} | {lr:g} | {cells} | {'–' if med is None else f'{med:g}'} | "
                f"{ratio} | {to_star} | {gone}/{len(seeds)} |"
            )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, reached_over: int = 1) -> Path:
    """Each file's methods, their median time over the fastest median there (auto in green, a method that never
    reached the target in half its seeds drawn hatched at the top), with AIM across: the criterion at a glance."""
    by = _by_method(rows, reached_over)
    names = [n for n in REGIME_BUDGET_S if any(k[0] == n for k in by)]
    if not names:
        raise ValueError(f"no runs with times over {reached_over} evaluations to draw")
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        medians = _medians(by, name)
        best = min((t for t in medians.values() if t is not None), default=None)
        ratios = {k: (t / best if t is not None and best else None) for k, t in medians.items()}
        top = max([AIM * 1.5, *(r for r in ratios.values() if r is not None)])
        for i, ((_, method, _), ratio) in enumerate(ratios.items()):
            colour = "tab:green" if method == AUTO else "tab:gray"
            ax.bar(i, top if ratio is None else ratio, color=colour, hatch="//" if ratio is None else "")
        ax.axhline(AIM, color="black", linestyle="--", label=f"{AIM}x of the fastest")
        labels = [f"{'auto' if m == AUTO else m} {lr:g}" for _, m, lr in ratios]
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel(f"median {time_label(reached_over)}\nover the fastest's")
    seeds = len({r["seed"] for runs in by.values() for r in runs.values()})
    return save(fig, list(axes[0]), f"The regime files: auto (green) and each file's fastest, {seeds} seeds", path)


def _t_star(name: str) -> float:
    """T* of the file's cluster in virtual seconds, as the regime study gives it (`reference_s`)."""
    profile = next(p for p in regimes(REGIME_METHODS, (0,), (0,)) if p.profile == name)
    star = reference_s(asdict(profile))
    assert star is not None, "the regime study's setting is the one K(B) was measured for"
    return star


def _median(times: dict[int, float | None]) -> float | None:
    """The median over seeds, a run that never reached the target counting as the slowest (None: half never)."""
    values = sorted((float("inf") if t is None else t) for t in times.values())
    if not values:
        return None
    med = statistics.median(values)
    return None if med == float("inf") else med


def add_reached_over(p: argparse.ArgumentParser) -> None:
    """`--reached-over K`, the reading of a time to the target both judging benchmarks take (`time_label`)."""

    def evaluations(text: str) -> int:
        k = int(text)
        if k < 1:
            raise argparse.ArgumentTypeError(f"{k}: give at least 1 evaluation")
        return k

    p.add_argument(
        "--reached-over",
        type=evaluations,
        default=1,
        metavar="K",
        help="a time to the target is the first evaluation at which the mean of the last K reaches it (default 1: "
        "the first at or above it); runs of each K are kept apart",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auto_default", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--lr-auto",
        type=float,
        help="auto's --lr on every file, untuned (default: tuned per file, as the regime study tunes every method)",
    )
    p.add_argument("--tune-seeds", type=int, nargs="+", help=f"auto's tuning seeds (default: {TUNED_IN}'s)")
    p.add_argument("--files", nargs="+", default=list(REGIME_BUDGET_S), choices=list(REGIME_BUDGET_S))
    p.add_argument("--methods", nargs="+", help="only these methods (default: all of the file's)")
    add_reached_over(p)
    p.add_argument("--plot", type=Path, help="draw each file's methods over its fastest to this PNG")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    files = [name for name in REGIME_BUDGET_S if name in args.files]
    if args.lr_auto is not None:
        lr_auto: dict[str, float | None] = dict.fromkeys(files, args.lr_auto)
    elif not args.methods or AUTO in args.methods:
        lr_auto = tune_auto(files, args.jobs, args.out, log, tuple(args.tune_seeds or ()), args.reached_over)
    else:
        lr_auto = dict.fromkeys(files)  # auto is not run here
    path = args.out / "auto_default.jsonl"
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    have = {_item(r) for r in done}
    todo = [
        i
        for i in plan(args.seeds, lr_auto, args.reached_over)
        if (not args.methods or i[1] in args.methods) and i not in have
    ]
    with path.open("a") as f:
        for (name, method, lr, seed, reached_over), r in run_parallel(
            _run, todo, args.jobs, lambda i, r: f"{i[0]} {i[1]} lr {i[2]} seed {i[3]}: {r['t']}", log
        ):
            row = {"file": name, "method": method, "lr": lr, "seed": seed, "reached_over": reached_over, **r}
            done.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
    print(table(done, args.reached_over))
    if args.plot:
        print(f"plot: {plot(done, args.plot, args.reached_over)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
