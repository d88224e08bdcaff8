"""`dynabatch run` end to end: each protocol and batch policy trains (here, or in the test named below), and the run
folder is complete."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from dynabatch.common.planning.prediction import POLICIES
from dynabatch.common.planning.protocol_switch import SWITCHABLE
from harness import mlp_job, run_job, trained_its_epochs
from tools import need_fashion_mnist

pytestmark = pytest.mark.slow

MLP_PARAMS = 235_146


# The protocols and batch policies that no other real run trains: LB-BSP (ssgd, dynamic), n-softsync, ssp under
# dynamic batches, local SGD under dynamic batches, and MSD. The others each have theirs: ASGD (asgd, fixed) is
# the default job, test_the_main_job_learns_fashion_mnist's; DBS-SGD (asgd, dynamic) test_byzantine_workers's
# twin; SSGD (ssgd, fixed) test_byzantine_aggregation's twin and test_travelling_buffers's; local SGD under fixed
# batches test_membership's and test_travelling_buffers's; ssp under fixed batches test_ssp's; rennala and
# ringmaster test_protocols's.
PAIRS = [("dynamic", "ssgd"), ("fixed", "softsync"), ("dynamic", "ssp"), ("dynamic", "local"), ("dynamic", "msd")]


@pytest.mark.data
@pytest.mark.parametrize("policy, protocol", PAIRS, ids=[f"{p}-{q}" for p, q in PAIRS])
def test_each_protocol_and_batch_policy_trained_nowhere_else_learns_fashion_mnist(
    tmp_path: Path, protocol: str, policy: str
) -> None:
    """A quick setting (the MLP for a quarter epoch, two workers 1x and 2x, the final model evaluated);
    full runs are the benchmarks' job, and the default job's CNN is test_the_main_job_learns_fashion_mnist's.
    The MLP travels as much as the CNN (235k parameters against 215k) for far less compute: one run here took
    14 s and 20 s of CPU with it, 24 s and 36 s with the CNN (side by side), and reached 75% either way.
    Each trains the epochs it was asked for, past them by at most one push per worker, with its figures
    reported (harness.trained_its_epochs): LB-BSP once ended at 1.78 of 2 epochs with every worker marked as
    having left early and no throughput figures."""
    need_fashion_mnist()
    run, _ = run_job(
        tmp_path,
        "r",
        *mlp_job(0.25, "1", "2", dataset="fashion-mnist"),
        "--protocol",
        protocol,
        "--batch-policy",
        policy,
        "--eval-interval-s",
        "600",
    )
    summary = trained_its_epochs(run)
    assert summary["final_eval"]
    assert summary["protocol"] == protocol and summary["batch_policy"] == policy
    # Learning (chance: 10%), not how well: beside a second suite softsync once ended at 63% and msd at 57.6% (alone,
    # and beside four or eight CPU hogs, msd ended at 81 to 83%, three runs each).
    assert summary["final_test_acc"] > 0.50, summary
    batches = [w["final_batch"] for w in summary["workers"].values()]
    if policy == "fixed":
        assert set(batches) == {96}, batches  # a worker that rejoined under load keeps its fixed batch too
    round_trip = 2 * MLP_PARAMS * 4  # the bytes of one pull and one push
    per_step = round_trip / 96  # bytes per sample of a round trip per 96-sample step
    if protocol in ("local", "msd"):
        # judged per step, not per sample: beside a second suite msd's dynamic split once gave the 2x worker 8 to 9
        # samples a step for most of the run (438 steps for 4,032 samples), and its deltas, once per H >= 5 steps,
        # came to a third of a round trip per 96 samples. The job's bytes include those of workers that left (one
        # dropped under load registers again as another), so its steps do too.
        last = [s for s in json.loads((run / "timeline.json").read_text()) if s["workers"]][-1]
        steps = sum(w["steps"] for w in [*last["workers"].values(), *last["departed"].values()])
        assert last["bytes"] < steps * round_trip / 4, (
            f"deltas travel once per several steps: {steps} steps, {len(last['departed'])} departed"
        )
    elif policy == "fixed":
        assert summary["bytes_per_sample"] == pytest.approx(per_step, rel=0.1)


@pytest.fixture(scope="module")
def folder_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One epoch of the MLP on three workers named out of speed order (w0 need not be worker0), with its plots:
    (run folder, what it printed). What the folder holds and how the console names the workers do not depend on
    how long or what the job trained, so the two tests below read one job (about 7 s here). A progress line every
    0.1 s, so that one falls while all three workers are live; a STATUS every 0.1 s, so that the timeline has about
    200 rows (one per snapshot and worker), where 10 are asked for. asgd, not auto: auto may choose a round
    protocol that leaves the 4x worker out (batch 0, no step after warm-up), as it did under two suites at once."""
    return run_job(
        tmp_path_factory.mktemp("folder"),
        "r",
        *mlp_job(1, "2", "1", "4"),
        "--protocol",
        "asgd",
        "--eval-interval-s",
        "3",
        "--progress-s",
        "0.1",
        "--status-s",
        "0.1",
        plots=True,
    )


def test_run_folder_holds_timeline_plots_summary_and_targets(folder_job: tuple[Path, str]) -> None:
    """The summary, the timeline in both forms, the plots, the Prometheus targets, the checkpoint, the scheduler's
    saved state and the logs."""
    run, printed = folder_job
    assert "test accuracy" in printed and "epoch" in printed
    summary = json.loads((run / "summary.json").read_text())
    for key in ("final_test_acc", "final_test_loss", "wall_s", "samples_per_s", "workers"):
        assert summary[key] is not None, key
    assert summary["final_eval"], "the reported accuracy must be the final model's"
    assert len(summary["workers"]) == 3
    for w in summary["workers"].values():
        assert w["final_batch"] > 0 and w["mean_step_s_after_warmup"] > 0 and w["standalone_samples_per_s"] > 0
    rows = list(csv.DictReader((run / "timeline.csv").read_text().splitlines()))
    assert len(rows) > 10 and {"t", "worker", "batch", "samples_per_s"} <= rows[0].keys()
    timeline = json.loads((run / "timeline.json").read_text())
    assert timeline[-1]["finished"]
    for png in ("loss_accuracy.png", "workers.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    targets = json.loads((run / "prometheus_targets.json").read_text())
    roles = sorted(t["labels"]["role"] for t in targets)
    assert roles == ["evaluator", "ps", "scheduler", "worker", "worker", "worker"]
    assert (run / "checkpoints" / "shard-0.pt").exists()
    assert (run / "state" / "scheduler-dynabatch.json").exists(), "the scheduler saved the job's progress"
    assert (run / "logs" / "scheduler.log").exists()


def test_the_console_and_status_name_each_worker_with_its_slowdown_in_the_order_given(
    folder_job: tuple[Path, str],
) -> None:
    """The scheduler's ids number workers as they join (w0 need not be worker0); the progress line, the final
    table, summary.json and STATUS name each by its name and slowdown, in the order of --slowdowns."""
    run, printed = folder_job
    given = ["worker0(2x)", "worker1(1x)", "worker2(4x)"]
    listed = [re.findall(r"(\S+) b=\d+", line.split(" | ", 1)[1]) for line in printed.splitlines() if " | " in line]
    assert given in listed, printed  # all three live between the last one's HELLO and the first one's BYE
    assert all(names == [g for g in given if g in names] for names in listed), printed
    assert [line.split()[0] for line in printed.splitlines() if " id w" in line] == given, printed
    summary = json.loads((run / "summary.json").read_text())
    assert [f"{w['name']}({w['slowdown']})" for w in summary["workers"].values()] == given
    shown = {
        f"{w['name']}({w['slowdown']})"
        for snap in json.loads((run / "timeline.json").read_text())
        for w in snap["workers"].values()
    }
    assert shown == set(given), "every STATUS gives each worker the slowdown it was launched with"


@pytest.mark.data
def test_the_main_job_learns_fashion_mnist(tmp_path: Path) -> None:
    """The default job, shortened to half an epoch: the CNN must be well on its way to 88%, and auto (the default
    protocol and batch policy) has chosen from the workers it measured."""
    need_fashion_mnist()
    run, _ = run_job(tmp_path, "r", "--epochs", "0.5", timeout_s=400)
    summary = json.loads((run / "summary.json").read_text())
    timeline = json.loads((run / "timeline.json").read_text())
    accuracies = [s["test_acc"] for s in timeline if s.get("test_acc") is not None]
    assert max(accuracies) >= 0.75, accuracies
    # Asynchronous SGD this early is noisy: after half an epoch the final accuracy was 81.0 to 82.7% with three
    # such jobs at once (83% after one epoch, 85-86% after 1.5), and one seen under a loaded CI machine dipped by
    # 2.4 points between two evaluations.
    assert summary["final_test_acc"] >= 0.72, summary
    assert summary["batch_policy"] == "auto" and summary["auto_protocol"], (
        "the defaults: protocol and batch policy auto"
    )
    assert summary["protocol"] in SWITCHABLE and summary["auto_policy"] in POLICIES, summary
    assert not summary["auto_reason"].startswith("fixed until"), (
        f"auto chose from measurements: {summary['auto_reason']}"
    )


def test_workers_with_their_own_largest_batch_micro_batches_and_loader_processes_train(tmp_path: Path) -> None:
    """The fastest worker holds at most 40 samples; every worker runs passes of 16 and loads ahead in 2 processes.
    Under asgd, whose split the assertions below describe (auto may switch to local SGD, which at this --lr ended
    at 75% beside a second suite)."""
    run, printed = run_job(
        tmp_path,
        "r",
        *mlp_job(2),
        "--protocol",
        "asgd",
        "--max-batches",
        "40",
        "0",
        "0",
        "--micro-batch",
        "16",
        "--loader-workers",
        "2",
        "--eval-interval-s",
        "3",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    assert summary["final_test_acc"] > 0.8, summary
    workers = {w["name"]: w for w in summary["workers"].values()}
    assert workers["worker0"]["max_batch"] == 40 and workers["worker1"]["max_batch"] == 0
    timeline = json.loads((run / "timeline.json").read_text())
    for snap in timeline:
        for w in snap["workers"].values():
            assert w["name"] != "worker0" or w["batch"] <= 40, snap["t"]
    # A STATUS shows each worker's batch as the shards bound it: during a re-split a worker's larger batch shows
    # only once every shard has confirmed it (scheduler/allocator.py, `batch_of`), and past the budget's allotment
    # the last batches are what is left. So the split is judged on the STATUSes while the budget lasted whose
    # batches were whole (beside a second suite, the last such STATUS caught a re-split: 165 of 192).
    whole = [
        {w["name"]: w["batch"] for w in s["workers"].values()}
        for s in timeline
        if s["unallotted"] and len(s["workers"]) == 3 and sum(w["batch"] for w in s["workers"].values()) == 192
    ]
    assert whole, "the others take what worker0 cannot: no STATUS had the whole global batch split"
    assert all(b["worker0"] <= 40 < b["worker1"] for b in whole), whole
    assert workers["worker0"]["final_batch"] <= 40
    assert all(w["mean_data_s_after_warmup"] > 0 for w in workers.values()), "waiting for data is measured"
    log = (run / "logs" / "worker0.log").read_text()
    assert "passes of at most 16 samples" in log and "loaded ahead by 2 processes" in log
    assert "data" in printed
    assert not list(run.glob("*.png")) and (run / "timeline.json").exists(), "--no-plots draws none, keeps the data"
