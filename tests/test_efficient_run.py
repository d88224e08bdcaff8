"""`dynabatch run --batch-policy efficient`: the batches a real job's STATUS reports are the efficient rule's
(scheduler/efficient_batches.py) for the workers as their heartbeats measured them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from dynabatch.scheduler.efficient_batches import efficient_batches, knee
from dynabatch.scheduler.speed_model import StepModel
from harness import mlp_job, run_job

pytestmark = pytest.mark.slow

B, CAPS = 96, {"worker0": 64, "worker1": 32, "worker2": 16}


def _measured(worker: dict[str, Any]) -> StepModel:
    """A worker's step as its last heartbeat reported it: what it spent besides computing and taking its samples
    is fixed, the rest per sample (SpeedModel.overhead_fit's reading of one step)."""
    times = worker["times"]
    compute = times["compute_s"] + times["data_s"]
    return StepModel(max(0.0, times["step_s"] - times["wait_s"] - compute), compute / worker["batch"])


def _median_model(steps: list[StepModel]) -> StepModel:
    """The median fixed and per-sample cost of a worker's sampled steps."""
    return StepModel(statistics.median(m.fixed_s for m in steps), statistics.median(m.per_sample_s for m in steps))


def test_a_real_jobs_batches_follow_the_efficient_rule(tmp_path: Path) -> None:
    """Three workers capped at 64, 32 and 16 samples, B = 96, the MLP on synthetic data for an epoch. A
    step's fixed cost (its pull and push on loopback) is worth far more than 64 samples' compute here, so every
    knee is above its worker's cap and B is below the caps' sum: the rule gives each worker the same fraction
    of its cap, whatever the exact measured costs, and the timeline's STATUS reports say so once every worker
    has reported a step."""
    run, _ = run_job(
        tmp_path,
        "r",
        *mlp_job(1, "1", "1", "2"),
        "--max-batches",
        *map(str, CAPS.values()),
        "--protocol",
        "asgd",
        "--batch-policy",
        "efficient",
        "--global-batch",
        str(B),
        "--status-s",
        "0.2",
        "--eval-interval-s",
        "600",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["batch_policy"] == "efficient"
    timeline = json.loads((run / "timeline.json").read_text())
    stepping = [
        s
        for s in timeline
        if len(s["workers"]) == 3 and all(w["steps"] > 1 for w in s["workers"].values()) and s["unallotted"] > 0
    ]
    assert stepping, (
        "no STATUS with every worker stepping while the budget lasted (after it, the last batches "
        "are what is left: common/allotment.py)"
    )
    expected = {"worker0": 55, "worker1": 27, "worker2": 14}  # each the same fraction of its cap

    def batches(status: dict[str, Any]) -> dict[str, int]:
        return {w["name"]: w["batch"] for w in status["workers"].values()}

    # A STATUS shows a worker's last step, which its allotment may have cut short near the budget's end, or which
    # an earlier split (before every worker's costs were measured) sized: the rule's split must be reached and be
    # the rule's for the workers as measured there. One step is one sample of a worker's costs, which a loaded
    # machine may stretch tenfold (beside a second suite, one step of worker0's read 2.1 ms a sample against its
    # neighbours' 0.06): each worker's costs are the median over the steps STATUS showed while the split held.
    reached = [s for s in stepping if batches(s) == expected]
    assert reached, [batches(s) for s in stepping]
    models = {
        name: _median_model([_measured(w) for s in reached for w in s["workers"].values() if w["name"] == name])
        for name in CAPS
    }
    assert all(knee(models[name]) > cap for name, cap in CAPS.items()), (models, len(reached))
    assert efficient_batches(models, B, 8, 1024, CAPS) == expected
    assert {w["name"]: w["final_batch"] for w in summary["workers"].values()} == expected
