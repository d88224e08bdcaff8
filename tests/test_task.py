"""The Task API: loading, the start-up checks, and user tasks trained end to end.

Shards and the scheduler run no task code: the jobs here start them without
`--task`, and only workers and the evaluator are told where the task file is.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dynabatch import schedule
from dynabatch.cluster.export import trained_model
from dynabatch.common.config import JobConfig, check_flags_against_task
from dynabatch.common.flags import ConfigError
from dynabatch.common.tasks.builtin_tasks import builtin_task
from dynabatch.common.tasks.catalog import BUILTIN_METRICS
from dynabatch.common.tasks.task_check import check_task, load_task
from dynabatch.common.wire.messages import WorkerAssignment
from dynabatch.optim import SGD, Adam, AdamW, OptimizerSpec
from dynabatch.task import Task
from dynabatch.task_error import TaskError
from dynabatch.worker.local_steps import inner_scale
from hang_guard import hang_guard_s
from harness import Cluster, Proc, run_job, wait_for

TASKS = Path(__file__).resolve().parent / "tasks"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests/tasks/nowhere.py:task", "no file"),
        ("tests/tasks/broken_import.py:task", "No module named 'this_module_does_not_exist'"),
        ("tests/tasks/bad.py:missing", "has no attribute 'missing'"),
        ("tests/tasks/bad.py:not_a_task", "is a dict, not a dynabatch.Task"),
        ("tests.tasks.bad", "expected FILE.py:ATTR"),
        ("no_such_package.module:task", "No module named 'no_such_package'"),
        ("tests/tasks/negative_lr.py:task", "optimizer adam: lr must be a finite non-negative number, got -0.001"),
        ("tests/tasks/lion.py:task", "optimizer 'lion' is not applied by the shards"),
    ],
)
def test_a_task_that_cannot_be_loaded_is_named_with_the_reason(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_task(spec)


@pytest.mark.parametrize(
    "attr, message",
    [
        ("unseeded", "two builds of the model differ in weight"),
        ("empty", "empty dataset"),
        ("empty_eval", "eval_data() gave an empty dataset"),
        ("float_metric", "metric <lambda> returned a float; a metric returns {name: (sum, count)}"),
        ("no_grad_loss", "the loss has no gradient (no grad_fn)"),
        ("vector_loss", "scalar"),
        ("float64", "parameter weight is torch.float64"),
    ],
)
def test_a_task_that_cannot_train_fails_its_start_up_check(attr: str, message: str) -> None:
    with pytest.raises(TaskError, match=re.escape(message)):
        check_task(load_task(f"tests/tasks/bad.py:{attr}"), seed=0)


def test_the_check_gives_the_signature_of_the_trainable_parameters_and_the_data_length() -> None:
    task = load_task(str(TASKS / "blobs.py") + ":task")
    sig, data, _ = check_task(task, seed=3)
    assert [p.name for p in sig.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sig.train_size == len(data) == 3000 and sig.total == 16 * 32 + 32 + 32 * 4 + 4


def test_frozen_parameters_do_not_travel() -> None:
    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        m[0].requires_grad_(False)
        return m

    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    sig, _, _ = check_task(Task(model=model, train_data=lambda: data), seed=0)
    assert [p.name for p in sig.params] == ["1.weight", "1.bias"]


@pytest.mark.slow
@pytest.mark.parametrize(("attr", "why"), [("unseeded", "differ"), ("vector_loss", "scalar")])
def test_dynabatch_run_refuses_a_bad_task_before_starting_anything(tmp_path: Path, attr: str, why: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynabatch.cli.main",
            "run",
            "--out",
            str(tmp_path),
            "--name",
            "r",
            "--task",
            f"tests/tasks/bad.py:{attr}",
        ],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )
    assert done.returncode == 2, done.stderr
    assert "dynabatch run:" in done.stderr and why in done.stderr, done.stderr
    assert not (tmp_path / "r").exists(), "nothing may be started or written"


def _plain_torch_accuracy(task: Task, epochs: float, batch: int, seed: int = 0) -> float:
    """The same model, data and SGD trained in one process: the reference a distributed run must reach."""
    assert isinstance(task.optimizer, SGD) and task.eval_data is not None
    model = task.build_model(seed)
    data, test = task.train_data(), task.eval_data()
    opt = torch.optim.SGD(model.parameters(), lr=task.optimizer.lr, momentum=task.optimizer.momentum)
    collate = task.collate_fn()
    g = torch.Generator().manual_seed(seed)
    for _ in range(int(epochs * len(data) / batch)):
        idx = torch.randint(0, len(data), (batch,), generator=g).tolist()
        opt.zero_grad()
        torch.autograd.backward(task.loss_fn()(model, collate([data[i] for i in idx])))
        opt.step()
    with torch.no_grad():
        whole = collate([test[i] for i in range(len(test))])
        return task.metric_fns()[0](model, whole)["accuracy"][0] / len(test)


@pytest.mark.slow
def test_a_user_task_trains_with_its_own_loss_metrics_and_schedule_and_matches_plain_torch(tmp_path: Path) -> None:
    run, printed = run_job(
        tmp_path,
        "r",
        "--task",
        f"{TASKS / 'blobs.py'}:task",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--epochs",
        "3",
        "--global-batch",
        "64",
        "--eval-interval-s",
        "2",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    metrics = summary["final_metrics"]
    assert set(metrics) == {"loss", "accuracy", "top2"}, metrics
    assert metrics["top2"] >= metrics["accuracy"] and summary["final_test_acc"] == metrics["accuracy"]
    reference = _plain_torch_accuracy(load_task(f"{TASKS / 'blobs.py'}:task"), epochs=3, batch=64)
    assert metrics["accuracy"] >= reference - 0.03, (metrics, reference)
    assert "top2" in printed


@pytest.mark.slow
def test_a_task_with_adamw_is_trained_by_the_shards(tmp_path: Path) -> None:
    """AdamW with biases left undecayed, applied by the shards under asgd with dynamic batches
    (one step per B accumulated samples); the start-up check now takes it."""
    spec = f"{TASKS / 'blobs_adamw.py'}:task"
    check_task(load_task(spec), seed=0)
    run, _ = run_job(
        tmp_path,
        "r",
        "--task",
        spec,
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--epochs",
        "1",
        "--global-batch",
        "64",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_metrics"]["accuracy"] >= 0.9, summary
    shard_log = (run / "logs" / "ps0.log").read_text()
    assert "AdamW(name='adamw', lr=0.01, weight_decay=0.01, no_decay=('bias',)" in shard_log


@pytest.mark.slow
def test_shards_and_the_scheduler_serve_a_task_they_never_see_and_refuse_a_different_model(tmp_path: Path) -> None:
    """The task file lives only where the workers are told; a worker with another model or
    another training set is refused by the shards, naming what differs, and exits 2."""
    elsewhere = tmp_path / "user_code"
    elsewhere.mkdir()
    for name in ("blobs.py", "blobs_variants.py"):
        shutil.copy(TASKS / name, elsewhere / name)
    c = Cluster(tmp_path, ["--epochs", "1000", "--liveness-timeout-s", "30"])
    try:
        c.scheduler()
        shard = c.shard(0)
        good = c.worker("good", "--task", f"{elsewhere / 'blobs.py'}:task")
        c.wait_status("the user's task to train", lambda s: any(w.steps > 3 for w in s.workers.values()))
        status = c.status()
        assert status is not None
        assert status.train_size == 3000, "the scheduler counts epochs from the shards' signature"
        for attr, differs in (("wider", "parameter 0 is 0.weight [48, 16]"), ("shorter", "2000 samples here, 3000")):
            bad = c.worker(attr, "--task", f"{elsewhere / 'blobs_variants.py'}:{attr}")

            def exited(bad: Proc = bad) -> bool:
                return bad.proc.poll() is not None

            assert wait_for(f"{attr} to exit", exited, 60) is not None
            assert bad.proc.returncode == 2 and differs in bad.log_text(), bad.log_text()
        assert good.alive() and shard.alive()
    finally:
        c.stop()


@pytest.mark.slow
def test_a_job_shorter_than_a_heartbeat_still_moves_through_its_schedule(tmp_path: Path) -> None:
    """blobs' warm-up starts at factor 0; one worker trains one epoch in about a second, less than the
    scheduler's progress reports take to arrive: the shards' own sample count must move the schedule."""
    run, _ = run_job(
        tmp_path, "r", "--task", f"{TASKS / 'blobs.py'}:task", "--workers", "1", "--slowdowns", "1", "--epochs", "1"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_metrics"]["accuracy"] > 0.6, summary["final_metrics"]  # chance is 0.25


@pytest.mark.parametrize(
    "job, optimizer, error",
    [
        (JobConfig(), SGD(lr=0.1), None),
        (JobConfig(lr=0.5, momentum=0.9), None, None),  # no optimizer in the task: the flags are the shards' SGD
        (
            JobConfig(lr=0.5),
            SGD(lr=0.1),
            "--lr: the task names the shards' optimizer (sgd, lr 0.1); change it in the task, or drop the flag",
        ),
        (
            JobConfig(momentum=0.9, nesterov=True, epochs=2),
            Adam(),
            "--momentum, --nesterov: the task names the shards' optimizer (adam, lr 0.001)",
        ),
        (JobConfig(weight_decay=0.0), AdamW(), "--weight-decay: the task names"),
        (JobConfig(protocol="local"), None, None),
        (
            JobConfig(protocol="msd"),
            SGD(lr=0.1),
            "--protocol msd: workers step with SGD from --lr, --momentum and "
            "--weight-decay and the shards apply the outer optimizer, so the task's "
            "optimizer (sgd) would not be used",
        ),
    ],
)
def test_the_flags_against_task_rule(job: JobConfig, optimizer: OptimizerSpec | None, error: str | None) -> None:
    """One rule, decided from the job and the task alone (what a worker has), for every entry point."""
    if error is None:
        check_flags_against_task(job, optimizer)
    else:
        with pytest.raises(ConfigError) as caught:
            check_flags_against_task(job, optimizer)
        assert str(caught.value).startswith(error) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"model": torch.nn.Linear(4, 2)}, TypeError, "model must be a function that builds the model, got Linear"),
        ({"schedule": "cosine"}, TypeError, "schedule must be a dynabatch.schedule"),
        ({"optimizer": "sgd"}, TypeError, "optimizer must be a dynabatch.optim spec"),
        ({"loss": "mse"}, TypeError, "loss must be a function"),
        ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm must be a positive finite number"),
        ({"clip_grad_norm": math.inf}, ValueError, "clip_grad_norm must be"),
    ],
)
def test_a_task_field_of_the_wrong_kind_is_refused_where_the_task_is_written(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each failed only inside the workers (a traceback, restarted three times), or trained wrongly without a word
    (a negative clip turned every gradient round: 9.9% accuracy, exit 0)."""
    task = {"model": lambda: torch.nn.Linear(4, 2), "train_data": list, **fields}
    with pytest.raises(error, match=message):
        Task(**task)


def test_a_delta_protocols_inner_steps_follow_the_tasks_schedule_at_the_jobs_progress() -> None:
    """The shards' outer optimizer steps at --outer-lr; the workers' inner SGD takes the schedule's factor at the
    progress the scheduler sends them."""
    halved = schedule.step([0.5], gamma=0.5)
    assert inner_scale(WorkerAssignment(assignment_id=1, lr_scale=0.8, progress=0.4), halved) == 0.8
    assert inner_scale(WorkerAssignment(assignment_id=1, lr_scale=0.8, progress=0.6), halved) == 0.4
    assert inner_scale(WorkerAssignment(assignment_id=1, progress=0.0), schedule.warmup_cosine(0.1)) == 0.0


@pytest.mark.slow
def test_a_schedule_of_zero_leaves_a_local_sgd_model_where_it_began(tmp_path: Path) -> None:
    """The inner steps ignored the task's schedule: a schedule of 0 trained to 92.45% under local. Followed, every
    inner step is 0 and so is every delta: the job ends with the model its factory made, to the bit. (msd's loop is
    the same `_LocalSteps`, its scale the same `inner_scale`.)"""
    spec = f"{TASKS / 'blobs_frozen.py'}:frozen"
    run, _ = run_job(
        tmp_path, "r", "--task", spec, "--protocol", "local", "--workers", "2", "--slowdowns", "1", "1",
        "--epochs", "1", "--global-batch", "64", "--local-steps", "2",
    )  # fmt: skip
    trained, initial = trained_model(run), load_task(spec).build_model(JobConfig().seed)
    assert json.loads((run / "summary.json").read_text())["samples"] >= 3000, "it trained its epoch"
    for (name, ours), theirs in zip(trained.state_dict().items(), initial.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), f"{name} moved under a schedule of 0"


def test_optimizer_flags_beside_a_task_that_names_its_optimizer_are_an_error_not_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dynabatch run` refuses before anything starts (the flag may come from the environment too), and
    `dynabatch check` applies the same rule."""
    monkeypatch.setenv("DYNABATCH_MOMENTUM", "0.9")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynabatch.cli.main",
            "run",
            "--out",
            str(tmp_path),
            "--name",
            "r",
            "--task",
            f"{TASKS / 'blobs.py'}:task",
            "--lr",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )
    assert (done.returncode, done.stderr) == (
        2,
        "dynabatch run: --lr, --momentum: the task names the shards' "
        "optimizer (sgd, lr 0.1); change it in the task, or drop the flag\n",
    )
    assert not (tmp_path / "r").exists()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynabatch.cli.main",
            "check",
            "--task",
            f"{TASKS / 'blobs.py'}:task",
            "--protocol",
            "local",
        ],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )
    assert (done.returncode, done.stderr.split(":")[:2]) == (2, ["dynabatch check", " --protocol local"]), done.stderr


@pytest.mark.slow  # a scheduler, a shard and a worker that loads torch and the task
def test_a_hand_started_schedulers_optimizer_flags_meet_the_task_in_the_worker(tmp_path: Path) -> None:
    """A scheduler started by hand has no task: the worker that loads it applies the rule to the job it was
    sent, and exits 2 with the one line, as `dynabatch run` would have refused."""
    c = Cluster(tmp_path, ["--lr", "0.5", "--epochs", "1000", "--liveness-timeout-s", "30"])
    try:
        c.scheduler()
        c.shard(0)
        worker = c.worker("w", "--task", f"{TASKS / 'blobs.py'}:task")
        wait_for("the worker to exit", lambda: worker.proc.poll() is not None, 120)
        assert worker.proc.returncode == 2, worker.log_text()
        assert worker.reason() == (
            "dynabatch worker: --lr: the task names the shards' optimizer (sgd, lr 0.1); "
            "change it in the task, or drop the flag"
        ), worker.log_text()
    finally:
        c.stop()


def test_a_built_in_job_reports_the_metrics_its_run_checks_targets_against() -> None:
    task = builtin_task("synthetic", "mlp")
    assert set(check_task(task, seed=0).metric_names) == set(BUILTIN_METRICS)
