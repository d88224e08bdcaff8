"""The predictor against the simulator: every modelled method's predicted time to target, samples/s and staleness
beside the simulated ones on each cluster a study ran (the cluster files, the drawn clusters), and auto's pick
(`choose` over every modelled protocol and policy) against the best simulated method (bench/RESULTS.md 19).

    python -m bench.prediction_accuracy DIR/regimes-reduced DIR/regimes-drawn

The predictions are made from the cluster alone (bench/auto_evidence.py `predictor_cluster`), never from a run; a
study folder only supplies the simulated figures (its results.json, bench/tuned_study.py).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.auto_evidence import AUTO_METHODS, evidence_row, predictor_cluster, render_evidence
from bench.tuned_study import CLUSTER_FILES, method_rows
from dynabatch.common.planning.cluster_file import ClusterFile
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import Prediction, predict_all


@dataclass(frozen=True)
class Studied:
    """One cluster a study ran: its file and the study's rows per method (`method_rows`)."""

    name: str
    file: ClusterFile
    rows: list[dict[str, Any]]


def studied(folder: Path) -> list[Studied]:
    """The cluster files and drawn clusters of a study folder, with what the simulator measured on each."""
    res = json.loads((folder / "results.json").read_text())
    out = []
    for name, p in res["profiles"].items():
        runs = res["report"].get(name)
        known = CLUSTER_FILES.get(name)
        if runs and known is not None and known.file is not None:
            out.append(Studied(name, known.file, method_rows(p, runs, res["chosen"].get(p["lr_from"] or name, {}))))
    return out


def _predictions(file: ClusterFile) -> dict[str, Prediction]:
    return {AUTO_METHODS[p.protocol, p.policy]: p for p in predict_all(predictor_cluster(file), STUDY_NOISE)}


def _s(t: float) -> str:
    return f"{t:.0f}" if math.isfinite(t) else "–"


def render_times(clusters: Sequence[Studied]) -> list[str]:
    """Per cluster: each modelled method's predicted / simulated time to target (s; – never in the budget, blank
    not run)."""
    methods = list(AUTO_METHODS.values())
    out = [
        "| cluster | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for c in clusters:
        ran, predicted = {r["method"]: r for r in c.rows if r.get("runs")}, _predictions(c.file)
        cells = [
            f"{_s(predicted[m].time_s)} / {_s(ran[m]['time'])}" if m in ran else f"{_s(predicted[m].time_s)} / "
            for m in methods
        ]
        out.append(f"| {c.name} | " + " | ".join(cells) + " |")
    return out


def accuracy(clusters: Sequence[Studied]) -> dict[str, dict[str, list[float]]]:
    """Per method, over the clusters it ran on: predicted / simulated samples/s, time (where the simulated run
    reached the target) and staleness (where the simulated one is above 0.5)."""
    out: dict[str, dict[str, list[float]]] = {m: {"sps": [], "time": [], "stale": []} for m in AUTO_METHODS.values()}
    for c in clusters:
        predicted = _predictions(c.file)
        for r in c.rows:
            p = predicted.get(r["method"])
            if p is None or not r.get("runs"):
                continue
            ratios = out[r["method"]]
            ratios["sps"].append(p.samples_per_s / r["sps"])
            if math.isfinite(r["time"]):
                ratios["time"].append(p.time_s / r["time"])
            if r["stale"] > 0.5:
                ratios["stale"].append(p.staleness / r["stale"])
    return out


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f}, {len(ratios)})"


def render_accuracy(clusters: Sequence[Studied]) -> list[str]:
    """Per method: the median predicted / simulated ratio (range, clusters) of samples/s, time and staleness."""
    out = [
        "| method | samples/s, predicted / simulated | time to target, predicted / simulated | staleness, predicted / "
        "simulated |",
        "|---|---:|---:|---:|",
    ]
    for method, ratios in accuracy(clusters).items():
        out.append(f"| {method} | {_spread(ratios['sps'])} | {_spread(ratios['time'])} | {_spread(ratios['stale'])} |")
    return out


def main(argv: Sequence[str]) -> int:
    clusters = [c for folder in argv for c in studied(Path(folder))]
    if not clusters:
        print("usage: python -m bench.prediction_accuracy STUDY_FOLDER... (folders with a results.json)")
        return 2
    lines = [
        "Predicted / simulated time to target (s) of every modelled method:",
        "",
        *render_times(clusters),
        "",
        "Prediction accuracy per method (median, range and number of clusters):",
        "",
        *render_accuracy(clusters),
        "",
        "auto's pick against the best simulated method:",
        "",
        *render_evidence([evidence_row(c.name, c.file, c.rows) for c in clusters]),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
