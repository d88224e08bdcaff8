"""The evidence for `auto`: on each cluster the study ran, the method common/planning/auto_choice.py `choose` picks
from the cluster alone, against the best method the simulator found there (issue 37: within 1.1x of the best in
every regime and never diverging; within 1.2x on clusters no tuning saw).

Two picks: `choose` over every modelled protocol and policy (what `--protocol auto`, the default, would run), and
the previous default job's (`--protocol asgd`, `--batch-policy auto`: the policy chosen for asgd, starting from
fixed, which it keeps unless another is predicted HYSTERESIS faster).

`choose` sees only what a running scheduler could measure (each worker's curve, cap and link, the shards, the
model's bytes: `cluster_of` of the cluster file) and the study's K(B); it never sees a simulated run. It ranks
the methods the predictor models (common/planning/prediction.py `PROTOCOLS` x `POLICIES`), so a method it cannot
choose (msync, rennala, the efficient policy, the delay-scaled step) counts against it only in the "best overall"
column. bench/prediction_accuracy.py sets every prediction beside the simulated figures.
"""

from __future__ import annotations

import math
from typing import Any

from dynabatch.common.config import JobConfig
from dynabatch.common.planning.auto_choice import Choice, choose
from dynabatch.common.planning.cluster_file import ClusterFile
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import Cluster, cluster_of, predict_all

AUTO_METHODS: dict[tuple[str, str], str] = {
    ("asgd", "fixed"): "asgd+fixed",
    ("asgd", "dynamic"): "DBS-SGD (capped weight)",
    ("ssgd", "fixed"): "ssgd+fixed",
    ("ssgd", "dynamic"): "LB-BSP (ssgd+dynamic)",
    ("ringmaster", "fixed"): "ringmaster+fixed",
    ("ringmaster", "dynamic"): "ringmaster+dynamic",
    ("local", "fixed"): "local+fixed",
    ("local", "dynamic"): "local+dynamic",
}
"""The study's method for each (protocol, policy) the predictor models (dbs_weight capped is the job's default)."""
DEFAULT = ("asgd", "fixed")
"""The previous default job's protocol (asgd, before `--protocol auto`) and the batch policy auto starts it with."""
BUDGET_PER_PREDICTED = 3.0
"""A drawn cluster's budget: this many times the fastest predicted time (between BUDGET_S's bounds), so that a
method the predictor ranks first has room to be as far off as it may be."""
BUDGET_S = (30.0, 150.0)


def predictor_cluster(file: ClusterFile) -> Cluster:
    """The cluster as the predictor sees it: the workers that start, the model cut at the job's chunk size."""
    return cluster_of(file, file.global_batch, JobConfig.chunk_bytes, JobConfig.min_batch)


def auto_choice(file: ClusterFile) -> Choice:
    """What `auto` picks on the cluster at its start (no method running yet, so no hysteresis)."""
    return choose(predictor_cluster(file), STUDY_NOISE)


def default_choice(file: ClusterFile) -> Choice:
    """The previous default job's batch policy: asgd's, chosen from fixed (the split auto starts with)."""
    return choose(predictor_cluster(file), STUDY_NOISE, current=DEFAULT, protocols=(DEFAULT[0],))


def budget_s(file: ClusterFile) -> float:
    """Virtual seconds for a drawn cluster's runs (BUDGET_PER_PREDICTED times the fastest prediction, bounded)."""
    fastest = predict_all(predictor_cluster(file), STUDY_NOISE)[0].time_s
    low, high = BUDGET_S
    return float(min(high, max(low, math.ceil(BUDGET_PER_PREDICTED * fastest))))


def evidence_row(name: str, file: ClusterFile, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """auto's pick on one cluster against the study's rows there (bench/tuned_study.py `method_rows`): its median
    time and divergences, the best method overall and the best of those auto chooses from."""
    choice, default = auto_choice(file), default_choice(file)
    ran = {r["method"]: r for r in rows if r.get("runs")}
    picked = AUTO_METHODS[(choice.protocol, choice.policy)]
    mine = ran.get(picked)
    kept = AUTO_METHODS[(default.protocol, default.policy)]

    def best(names: list[str]) -> dict[str, Any] | None:
        return min((ran[m] for m in names), key=lambda r: (r["time"], -r["acc"]), default=None)

    overall, modelled = best(list(ran)), best([m for m in AUTO_METHODS.values() if m in ran])
    return {
        "cluster": name,
        "choice": picked,
        "predicted_s": choice.prediction.time_s,
        "time": mine["time"] if mine else math.inf,
        "runs": mine["runs"] if mine else 0,
        "diverged": mine["diverged"] if mine else 0,
        "default": kept,
        "default_row": ran.get(kept),
        "best": overall,
        "best_modelled": modelled,
    }


def _time(t: float) -> str:
    return "–" if not math.isfinite(t) else f"{t:.0f} s"


def _vs(t: float, other: dict[str, Any] | None) -> str:
    if other is None or not math.isfinite(t) or not math.isfinite(other["time"]):
        return "–"
    return f"{t / other['time']:.2f}x"


def render_evidence(rows: list[dict[str, Any]]) -> list[str]:
    """The table: per cluster, auto's pick, its simulated time, and its ratio to the best overall and to the best of
    the methods auto chooses from."""
    out = [
        "| cluster | auto's pick (predicted) | its time to target (median) | diverged (runs) | best method (time) "
        "| auto / best | best auto can pick (time) | auto / that | the previous default (asgd + auto policy) "
        "| default / best | default diverged |",
        "|---|---|---:|---:|---|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        best, modelled, default = r["best"], r["best_modelled"], r["default_row"]
        d_time = default["time"] if default else math.inf
        out.append(
            f"| {r['cluster']} | {r['choice']} ({r['predicted_s']:.3g} s) | {_time(r['time'])} | "
            f"{r['diverged']}/{r['runs']} | {_named(best)} | {_vs(r['time'], best)} | {_named(modelled)} | "
            f"{_vs(r['time'], modelled)} | {r['default']} ({_time(d_time)}) | {_vs(d_time, best)} | "
            f"{default['diverged'] if default else 0}/{default['runs'] if default else 0} |"
        )
    return out


def _named(row: dict[str, Any] | None) -> str:
    return f"{row['method']} ({_time(row['time'])})" if row else "–"
