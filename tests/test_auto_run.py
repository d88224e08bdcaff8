"""`dynabatch run --batch-policy auto` on an emulated mixed-device cluster: STATUS names the policy auto runs and
why, and the split follows it (fixed while the workers are measured, then the chosen policy's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import mlp_job, run_job

pytestmark = pytest.mark.slow

B = 96


def test_auto_runs_fixed_while_measuring_then_lb_bsp_on_a_mixed_device_cluster(tmp_path: Path) -> None:
    """ssgd, two workers at full speed and one four times slower with 100 ms more per step (a device with a fixed
    cost, `--slowdowns F:A`; slow beyond what contention on a loaded machine does to the others' steps): a round
    waits for its slowest worker, so the predictor says equal step times (LB-BSP)
    reach the target first, and auto chooses `dynamic` once every worker has reported its first steps."""
    run, printed = run_job(
        tmp_path,
        "r",
        *mlp_job(1, "1", "1", "4:0.1"),
        "--protocol",
        "ssgd",
        "--batch-policy",
        "auto",
        "--global-batch",
        str(B),
        "--status-s",
        "0.2",
        "--eval-interval-s",
        "600",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["batch_policy"] == "auto" and summary["auto_policy"] == "dynamic"
    assert "batch policy auto runs dynamic: ssgd + dynamic: predicted fastest to target" in printed, printed
    said = [line for line in printed.splitlines() if line.startswith("batch policy auto runs ")]
    shown = [line.split(": ")[1] for line in said]  # the choice each line names
    assert shown[0] == "fixed until every worker has reported 8 steps" and "ssgd + dynamic" in shown, printed
    assert all(a != b for a, b in zip(shown, shown[1:], strict=False)) and not any(
        ": kept," in line for line in said
    ), (
        "a line when auto chooses, none when a revisit keeps its choice",
        printed,
    )
    timeline = json.loads((run / "timeline.json").read_text())

    measuring = [s for s in timeline if s["auto_policy"] == "fixed" and len(s["workers"]) == 3]
    assert all(s["auto_reason"].startswith("fixed until every worker has reported") for s in measuring), measuring
    # Fixed while measuring, in the decisions (a choice on every worker's first step can come before any STATUS
    # snapshot shows the batches handed out): every split of the three before auto's choice is B / 3 each.
    every = {(d["t"], d["reason"]): d for status in timeline for d in status["decisions"]}
    chose_at = min(t for t, reason in every if "auto chose dynamic" in reason)
    handed = [d["batches"] for (t, _), d in sorted(every.items()) if t < chose_at and len(d["batches"]) == 3]
    assert handed and all(set(b.values()) == {B // 3} for b in handed), f"fixed while measuring: {handed}"
    chosen = [s for s in timeline if s["auto_policy"] == "dynamic" and s["unallotted"] and len(s["workers"]) == 3]
    assert chosen, [(s["auto_policy"], s["auto_reason"]) for s in timeline]
    assert all(s["auto_reason"].startswith(("ssgd + dynamic: predicted", "ssgd + dynamic: kept")) for s in chosen)
    # LB-BSP's split, in the decisions from auto's choice on (a STATUS's batches lag them until the shards bound
    # the pushes by them): the batches sum to B and the slow device gets no more than either fast one and less than
    # the larger (LB-BSP may leave out the slowest workers together, a fast one with it).
    last = chosen[-1]
    names = {wid: w["name"] for wid, w in last["workers"].items()}
    decisions = {(d["t"], d["reason"]): d for status in chosen for d in status["decisions"]}
    switch = min(t for t, reason in decisions if "auto chose dynamic" in reason)
    split = [{names[w]: b for w, b in d["batches"].items()} for (t, _), d in sorted(decisions.items()) if t >= switch]
    assert all(sum(b.values()) == B for b in split), split
    fast = [(b["worker0"], b["worker1"]) for b in split]
    assert all(b["worker2"] <= min(f) and b["worker2"] < max(f) for b, f in zip(split, fast, strict=True)), split
    assert all(w["batch"] <= split[-1][w["name"]] for w in last["workers"].values()), "STATUS shows the split's"
