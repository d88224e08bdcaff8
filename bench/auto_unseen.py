r"""`--protocol auto` on mixed clusters no tuning saw, beside every method it chooses from, run side by side on the
same code: is auto within AIM of the best method there, and does it ever diverge (issue 37; bench/RESULTS.md 26)?

The clusters are drawn by bench/drawn_clusters.py from `--draw-seed`: 2029 (DRAW_SEED) gives the ten the regime
study ran as drawn0 to drawn9; any other seed gives a set no one has seen, named `fresh{seed}-{i}`. Each runs for
its own budget (`auto_evidence.budget_s`, or the study's DRAWN_BUDGET_S for drawn0 to drawn9), momentum 0, stopped
at the target, every method at UNSEEN_LRS (no tuning on an unseen cluster: that is what makes it unseen) and auto at
`--lr-auto` (one step size for whatever it switches to, under the delay step). With several `--seeds`, each method
is judged by its median over them.

How far a verdict over a few seeds can be trusted (`--split`): the best method picked on the first half of the seeds
is run again on the second half. How often the best itself lands within AIM of its own median there is the most any
default can score on that verdict. Auto is judged on the second half against the same figure, beside it.

    python -m bench.auto_unseen --draw-seed 2029 --count 10 --jobs 2 --out DIR
    python -m bench.auto_unseen --draw-seed 7 --count 10 --seeds 0 1 2 3 4 5 --split --jobs 2 --out DIR
    python -m bench.auto_unseen --draw-seed 7 --also "ringmaster+fixed (delay step)=0.4" --jobs 2 --out DIR

`--reached-over K` takes a time to the target as the first evaluation at which the mean of the last K reaches it:
where a method levels off near the target, its evaluations move by several points from one to the next, and the
first one above the target is luck (bench/RESULTS.md 56).

`--also` runs other methods of the regime study beside the verdict, each at a step size of its own, and prints each
one's time against the verdict's best and against auto: a method auto might choose is measured on the same runs that
judge auto, without moving the verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.auto_default import AUTO, add_reached_over, run_row, time_label
from bench.auto_evidence import budget_s
from bench.drawn_clusters import DRAW_SEED, draw_clusters
from bench.parallel_runs import run_parallel
from bench.plots import plt, save
from bench.profile_file import simulated
from bench.tuned_study import CLUSTER_FILES, CLUSTERS, DRAWN_BUDGET_S, METHODS, Profile
from dynabatch.scheduler import auto_policy

UNSEEN_LRS = {
    "asgd+fixed": 0.02,
    "DBS-SGD (capped weight)": 0.04,
    "LB-BSP (ssgd+dynamic)": 0.4,
    "ringmaster+fixed": 0.04,
    "local+dynamic": 0.32,
}
"""The methods `auto` may choose, each at the median of the step sizes the regime study tuned for it on the cluster
files where it reached the target (bench/RESULTS.md 20). asgd + fixed is the previous default. Left out for the
machine's time: ringmaster + dynamic (never chosen), ssgd + fixed and local + fixed (never the best of a drawn
cluster in section 19: LB-BSP and local + dynamic were as fast or faster wherever they reached the target)."""
LR_AUTO = 0.28
"""Auto's one step size for whatever it runs under the delay step: one grid step below 0.4, at which auto was as fast
or faster on every regime file and within AIM on more unseen clusters, the draw run once afterwards included
(bench/RESULTS.md 62.4)."""
AIM = 1.2
UNMEASURED = "until every worker has reported"
"""What auto's last reason says while a worker is not measured; after it once chose, the reason says it is held
(HELD; "; held until" in runs stored before 2026-12-01, "as last chosen" before 2026-11-29)."""
HELD = (auto_policy.HELD, "; held until", "as last chosen")
TARGET = "0.80"


def cluster_name(draw_seed: int, i: int) -> str:
    """drawn{i} for the study's own draw, fresh{seed}-{i} for another."""
    return f"drawn{i}" if draw_seed == DRAW_SEED else f"fresh{draw_seed}-{i}"


Item = tuple[int, int, str, float, int, int]
"""One run: (draw seed, cluster, method, lr, seed, the evaluations a time to the target is the mean of)."""


def _profile(draw_seed: int, i: int, reached_over: int = 1) -> Profile:
    """The i-th cluster of the draw, registered where `sim_config` looks clusters up, at its own budget, its time to
    the target over `reached_over` evaluations."""
    name = cluster_name(draw_seed, i)
    file = replace(draw_clusters(i + 1, draw_seed)[i], name=name)
    cluster = simulated(file)
    CLUSTER_FILES[name] = cluster
    CLUSTERS[name] = lambda: cluster.workers
    budget = DRAWN_BUDGET_S.get(name) or budget_s(file)
    return Profile(
        name,
        cluster.global_batch,
        (),
        (),
        (),
        budget_s=budget,
        slower=1.0,
        eval_every_s=budget / 60,
        reached_over=reached_over,
    )


def _run(item: Item) -> tuple[Item, dict[str, Any]]:
    """One run -> `run_row`, with the cluster's budget."""
    draw_seed, i, method, lr, seed, reached_over = item
    profile = _profile(draw_seed, i, reached_over)
    return item, {**run_row(profile, method, lr, seed), "budget_s": profile.budget_s}


def plan(
    draw_seed: int,
    count: int,
    seeds: list[int],
    lr_auto: float,
    also: dict[str, float] | None = None,
    reached_over: int = 1,
) -> list[Item]:
    """Every cluster of the draw, auto and each method it may choose, and the methods `also` names at their step
    sizes, at every seed."""
    methods = {AUTO: lr_auto, **UNSEEN_LRS, **(also or {})}
    return [(draw_seed, i, m, lr, s, reached_over) for i in range(count) for m, lr in methods.items() for s in seeds]


def _item(row: dict[str, Any]) -> Item:
    """The run a stored row is (rows stored before `--reached-over` took a time over one evaluation)."""
    return (row["draw_seed"], row["i"], row["method"], row["lr"], row["seed"], row.get("reached_over", 1))


def median_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each method's median time to the target over the seeds of `rows` it ran (inf for a seed that never reached
    it, so a method that missed in most seeds has none)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(math.inf if r["t"] is None else r["t"])
    return {m: statistics.median(ts) for m, ts in by.items()}


def _ratio(t: float, best: float) -> float:
    """`t` over the best method's `best`; where no method reached the target, 1 for a run that did not either and 0
    for one that did."""
    return t / best if math.isfinite(best) else (1.0 if not math.isfinite(t) else 0.0)


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cluster, over the seeds its runs have (`median_times`: one seed on a drawn cluster cannot separate
    methods 1.3x apart, bench/RESULTS.md 44): auto's time, the best method's, their ratio, whether within AIM, and
    any divergence in any seed; what auto ran last and whether it chose, from its first seed's run. The previous
    default's time is inf where `--methods` left it out, so a run of a few methods is judged against those."""
    out = []
    for name in dict.fromkeys(r["cluster"] for r in rows):
        mine = [r for r in rows if r["cluster"] == name]
        times = median_times(mine)
        auto = times.pop(AUTO, math.inf)
        if not times:  # auto alone ran here (--methods): nothing to judge it by
            continue
        best = min(times, key=lambda m: times[m])
        ratio = _ratio(auto, times[best])
        runs = (r for r in mine if r["method"] == AUTO)
        run = min(runs, key=lambda r: r.get("seed", 0), default={"switched_to": "", "choices": []})
        out.append(
            {
                "cluster": name,
                "auto": auto,
                "switched_to": run["switched_to"] or "asgd",
                "chose": bool(run["choices"])
                and (UNMEASURED not in run["choices"][-1][1] or any(h in run["choices"][-1][1] for h in HELD)),
                "best": best,
                "best_t": times[best],
                "prev_default": times.get("asgd+fixed", math.inf),
                "ratio": ratio,
                "within": ratio <= AIM,
                "diverged": list(dict.fromkeys(r["method"] for r in mine if r["diverged"])),
            }
        )
    return out


def also_table(rows: list[dict[str, Any]], also: dict[str, float]) -> str:
    """Each method of `also` (run beside the verdict, not among those auto chooses from) on each cluster: its median
    time over the best method's of the verdict and over auto's, and the count within AIM of the best. So a method
    auto might one day choose is measured on the same runs that judge auto."""
    judged = verdicts([r for r in rows if r["method"] not in also])
    out = [
        "| cluster | best method (time) | auto | "
        + " | ".join(f"{m} at {lr:g}: time, / best, / auto" for m, lr in also.items())
        + " |",
        "|---|---|---:|" + "---|" * len(also),
    ]
    within = dict.fromkeys(also, 0)
    for v in judged:
        times = median_times([r for r in rows if r["cluster"] == v["cluster"] and r["method"] in also])
        cells = []
        for m in also:
            t = times.get(m, math.inf)
            ratio = _ratio(t, v["best_t"])
            within[m] += ratio <= AIM
            over_auto = f"{t / v['auto']:.2f}x" if math.isfinite(v["auto"]) else "auto never"
            cells.append(f"{t:.3g} s, {ratio:.2f}x, {over_auto}" if math.isfinite(t) else "never")
        auto = f"{v['auto']:.3g} s" if math.isfinite(v["auto"]) else "never"
        out.append(f"| {v['cluster']} | {v['best']} ({v['best_t']:.3g} s) | {auto} | {' | '.join(cells)} |")
    out += [f"\n{m} within {AIM}x of the best on {n} of {len(judged)} clusters" for m, n in within.items()]
    return "\n".join(out)


def split_verdicts(rows: list[dict[str, Any]], picked_on: set[int]) -> list[dict[str, Any]]:
    """Per cluster: the best method by its median over the seeds `picked_on` (the fastest of every method but
    auto), and over the other seeds of `rows` that method's median and auto's, each over the best's median on
    `picked_on`. Where the best itself is not within AIM on the other seeds, the seeds, not the method, decide the
    verdict: a time to target moves by a third with the seed alone on a drawn cluster (bench/RESULTS.md 44, 55)."""
    out = []
    for name in dict.fromkeys(r["cluster"] for r in rows):
        mine = [r for r in rows if r["cluster"] == name]
        picking = median_times([r for r in mine if r["seed"] in picked_on and r["method"] != AUTO])
        again = median_times([r for r in mine if r["seed"] not in picked_on])
        if not picking or AUTO not in again:
            continue
        best = min(picking, key=lambda m: picking[m])
        if best not in again:
            continue
        itself, auto = _ratio(again[best], picking[best]), _ratio(again[AUTO], picking[best])
        out.append(
            {
                "cluster": name,
                "best": best,
                "best_t": picking[best],
                "itself": itself,
                "auto": auto,
                "itself_within": itself <= AIM,
                "auto_within": auto <= AIM,
            }
        )
    return out


def split_table(rows: list[dict[str, Any]], picked_on: set[int]) -> str:
    """`split_verdicts` as a table, and the counts within AIM: the best method itself and auto."""
    found = split_verdicts(rows, picked_on)
    out = [
        f"The best method picked on seeds {sorted(picked_on)}, judged again on the others:",
        "| cluster | best method (its time when picked) | the best itself / its time | auto / the best's time |",
        "|---|---|---:|---:|",
    ]

    def x(r: float) -> str:
        return f"{r:.2f}x" if math.isfinite(r) else "never"

    out += [
        f"| {v['cluster']} | {v['best']} ({v['best_t']:.3g} s) | {x(v['itself'])} | {x(v['auto'])} |" for v in found
    ]
    itself, auto = (sum(v[k] for v in found) for k in ("itself_within", "auto_within"))
    out.append(
        f"\nwithin {AIM}x on the other seeds: the best method itself on {itself} of {len(found)} clusters, "
        f"auto on {auto}"
    )
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    """auto against the best method and the previous default on each cluster, and the count within AIM."""

    def s(t: float) -> str:
        return f"{t:.3g}" if math.isfinite(t) else "–"

    found = verdicts(rows)
    out = [
        "| cluster | auto (ran last; chose from measurements?) | best method (time) | asgd+fixed | auto / best | "
        "within 1.2x | diverged |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for v in found:
        out.append(
            f"| {v['cluster']} | {s(v['auto'])} s ({v['switched_to']}; {'chose' if v['chose'] else 'never chose'}) | "
            f"{v['best']} ({s(v['best_t'])} s) | "
            f"{s(v['prev_default'])} s | {v['ratio']:.2f}x | {'yes' if v['within'] else 'no'} | "
            f"{', '.join(v['diverged']) or 'none'} |"
        )
    within = sum(v["within"] for v in found)
    out.append(f"\nauto within {AIM}x of the best on {within} of {len(found)} clusters")
    return "\n".join(out)


def _time_to(rows: list[dict[str, Any]]) -> str:
    """What the rows' times are (`--reached-over`)."""
    return time_label(max((r.get("reached_over", 1) for r in rows), default=1))


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """auto's time over the best method's on each cluster, the AIM drawn across (a cluster where auto never reached
    the target drawn at the top, hatched)."""
    found = verdicts(rows)
    top = max([AIM * 1.5, *(v["ratio"] for v in found if math.isfinite(v["ratio"]))])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(found)), 4))
    for i, v in enumerate(found):
        ratio = v["ratio"] if math.isfinite(v["ratio"]) else top
        ax.bar(i, ratio, color="tab:green" if v["within"] else "tab:red", hatch="" if ratio < top else "//")
    ax.axhline(AIM, color="black", linestyle="--", label=f"{AIM}x of the best")
    ax.set_xticks(range(len(found)), [v["cluster"] for v in found], rotation=45, ha="right")
    ax.set_ylabel(f"{_time_to(rows)}:\nauto's / the best method's")
    within = sum(v["within"] for v in found)
    return save(fig, [ax], f"--protocol auto on unseen clusters: within {AIM}x on {within} of {len(found)}", path)


def split_plot(rows: list[dict[str, Any]], picked_on: set[int], path: Path) -> Path:
    """`split_verdicts` per cluster: the best method itself and auto on the seeds the best was not picked on, each
    over the best's time when picked, AIM drawn across (never reached: drawn at the top, hatched)."""
    found = split_verdicts(rows, picked_on)
    finite = [v[k] for v in found for k in ("itself", "auto") if math.isfinite(v[k])]
    top = max([AIM * 1.5, *finite])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(found)), 4))
    for k, (key, label, color) in enumerate(
        (("itself", "the best method itself", "tab:gray"), ("auto", "auto", "tab:blue"))
    ):
        heights = [v[key] if math.isfinite(v[key]) else top for v in found]
        bars = ax.bar([i + 0.4 * k - 0.2 for i in range(len(found))], heights, width=0.4, color=color, label=label)
        for bar, v in zip(bars, found, strict=True):
            bar.set_hatch("" if math.isfinite(v[key]) else "//")
    ax.axhline(AIM, color="black", linestyle="--", label=f"{AIM}x")
    ax.set_xticks(range(len(found)), [v["cluster"] for v in found], rotation=45, ha="right")
    ax.set_ylabel(f"{_time_to(rows)}:\nover the best's when picked")
    itself, auto = (sum(v[k] for v in found) for k in ("itself_within", "auto_within"))
    title = f"the best picked on seeds {sorted(picked_on)}, judged on the rest:\n"
    title += f"within {AIM}x, the best itself on {itself} of {len(found)}, auto on {auto}"
    return save(fig, [ax], title, path)


def _also(p: argparse.ArgumentParser, given: list[str]) -> dict[str, float]:
    """`--also`'s METHOD=LR pairs; a usage error naming the one that is not a regime study method at a positive
    step size."""
    allowed = [m for m in METHODS if m not in UNSEEN_LRS and m != AUTO]
    also: dict[str, float] = {}
    for item in given:
        name, _, lr = item.rpartition("=")
        try:
            step = float(lr)
        except ValueError:
            step = math.nan
        if name not in allowed or not step > 0 or not math.isfinite(step):
            p.error(
                f"--also {item!r}: give METHOD=LR, METHOD one of bench/tuned_study.py METHODS that the verdict does "
                f"not already run ({', '.join(allowed)}), LR a positive step size"
            )
        also[name] = step
    return also


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auto_unseen", description=__doc__.split("\n\n")[0])
    p.add_argument("--draw-seed", type=int, default=DRAW_SEED)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--clusters", type=int, nargs="+", help="only these clusters of the draw (default: all --count)")
    p.add_argument("--lr-auto", type=float, default=LR_AUTO, help="auto's --lr (under the delay step)")
    p.add_argument("--methods", nargs="+", help="only these methods (default: auto and every one of UNSEEN_LRS)")
    p.add_argument(
        "--also",
        nargs="+",
        default=[],
        metavar="METHOD=LR",
        help="also run these methods of the regime study (bench/tuned_study.py METHODS) at these step sizes, beside "
        "the verdict and not in it, e.g. 'ringmaster+fixed (delay step)=0.4'",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also pick each cluster's best method on the first half of --seeds and judge it and auto on the rest",
    )
    add_reached_over(p)
    p.add_argument("--plot", type=Path, help="draw auto / best per cluster to this PNG")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.split and len(args.seeds) < 2:
        p.error("--split needs at least two --seeds")
    also = _also(p, args.also)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"auto_unseen_{args.draw_seed}.jsonl"
    stored = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = [r for r in stored if _item(r)[-1] == args.reached_over]
    have = {_item(r) for r in done}
    todo = [
        i
        for i in plan(args.draw_seed, args.count, args.seeds, args.lr_auto, also, args.reached_over)
        if i not in have and (not args.methods or i[2] in args.methods) and (not args.clusters or i[1] in args.clusters)
    ]
    with path.open("a") as f:
        for (draw_seed, i, method, lr, seed, reached_over), r in run_parallel(
            _run, todo, args.jobs, lambda i, r: f"{cluster_name(i[0], i[1])} {i[2]} seed {i[4]}: {r['t']}", print
        ):
            row = {"draw_seed": draw_seed, "i": i, "cluster": cluster_name(draw_seed, i), "method": method}
            row |= {"lr": lr, "seed": seed, "reached_over": reached_over, **r}
            done.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
    ran = [r for r in done if r["seed"] in args.seeds and (r["method"] != AUTO or r["lr"] == args.lr_auto)]
    judged = [r for r in ran if r["method"] == AUTO or r["method"] in UNSEEN_LRS]
    print(table(judged))
    if also:
        print(also_table(judged + [r for r in ran if also.get(r["method"]) == r["lr"]], also))
    picked_on = set(args.seeds[: len(args.seeds) // 2])
    if args.split:
        print(split_table(judged, picked_on))
    if args.plot:
        print(f"plot: {plot(judged, args.plot)}")
        if args.split:
            print(f"plot: {split_plot(judged, picked_on, args.plot.with_name(args.plot.stem + '-split.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
