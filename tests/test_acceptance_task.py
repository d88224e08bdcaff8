"""Issue 9's acceptance run: a user's task (tests/tasks/fashion_bn_adamw.py: an MLP with BatchNorm on a
Fashion-MNIST subset, AdamW with `no_decay`, warm-up cosine, a metric of its own) trained by
`dynabatch run --workers 3 --slowdowns 1 2 4` comes within 3 points of the same model trained in one
plain-torch process, and `dynabatch export` gives a state_dict that plain PyTorch evaluates to the
reported accuracy within half a point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynabatch.common.tasks.task_check import load_task
from hang_guard import hang_guard_s
from harness import run_job
from plain_torch import evaluate_alone, train_alone
from tools import need_fashion_mnist

pytestmark = [pytest.mark.slow, pytest.mark.data]
SPEC = f"{Path(__file__).resolve().parent / 'tasks' / 'fashion_bn_adamw.py'}:task"
EPOCHS, BATCH = 4, 128


def test_a_users_batchnorm_adamw_task_matches_plain_torch_and_exports_what_it_reported(tmp_path: Path) -> None:
    need_fashion_mnist()
    run, _ = run_job(
        tmp_path,
        "r",
        "--task",
        SPEC,
        "--workers",
        "3",
        "--slowdowns",
        "1",
        "2",
        "4",
        "--epochs",
        str(EPOCHS),
        "--global-batch",
        str(BATCH),
        "--eval-interval-s",
        "3",
        timeout_s=400,
    )
    summary = json.loads((run / "summary.json").read_text())
    reported = summary["final_metrics"]
    assert summary["finished"] and summary["final_eval"] and {"accuracy", "top2", "loss"} <= reported.keys()
    task = load_task(SPEC)
    reference = evaluate_alone(task, train_alone(task, EPOCHS, BATCH))["accuracy"]
    assert reported["accuracy"] >= reference - 0.03, (reported, reference)

    out = tmp_path / "model.pt"
    done = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "export", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )
    assert done.returncode == 0, done.stderr
    model = task.model()
    model.load_state_dict(torch.load(out))
    exported = evaluate_alone(task, model)["accuracy"]
    assert abs(exported - reported["accuracy"]) <= 0.005, (exported, reported)
