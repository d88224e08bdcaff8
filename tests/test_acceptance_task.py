"""Issue 9's acceptance run: a user's task (tests/tasks/fashion_bn_adamw.py: an MLP with BatchNorm on a
Fashion-MNIST subset, AdamW with `no_decay`, warm-up cosine, a metric of its own) trained by
`dynabatch run --workers 3 --slowdowns 1 2 4` comes within 3 points of the same model trained in one
plain-torch process, and `dynabatch export` gives a state_dict that plain PyTorch evaluates to the
reported accuracy within half a point."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynabatch.common.task import load_task
from harness import run_job

pytestmark = [pytest.mark.slow, pytest.mark.data]
SPEC = f"{Path(__file__).resolve().parent / 'tasks' / 'fashion_bn_adamw.py'}:task"
EPOCHS, BATCH = 4, 128


def _plain_torch_accuracy() -> float:
    """The same task in one process with torch.optim.AdamW (the same groups) and the same schedule."""
    task = load_task(SPEC)
    model = task.build_model(0)
    spec = task.optimizer
    decay = [p for n, p in model.named_parameters() if not any(s in n for s in spec.no_decay)]
    rest = [p for n, p in model.named_parameters() if any(s in n for s in spec.no_decay)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=spec.lr,
                            weight_decay=spec.weight_decay)
    data, test, collate = task.train_data(), task.eval_data(), task.collate_fn()
    steps = math.ceil(EPOCHS * len(data) / BATCH)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = spec.lr * task.schedule.factor(step / steps)
        idx = torch.randint(0, len(data), (BATCH,), generator=g).tolist()
        opt.zero_grad()
        task.loss_fn()(model, collate([data[i] for i in idx])).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        x, y = collate([test[i] for i in range(len(test))])
        return float((model(x).argmax(-1) == y).float().mean())


def test_a_users_batchnorm_adamw_task_matches_plain_torch_and_exports_what_it_reported(tmp_path):
    if not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists():
        pytest.skip("apt-get install -y dataset-fashion-mnist")
    run, _ = run_job(tmp_path, "r", "--task", SPEC, "--workers", "3", "--slowdowns", "1", "2", "4",
                     "--epochs", str(EPOCHS), "--global-batch", str(BATCH), "--eval-interval-s", "3", timeout_s=400)
    summary = json.loads((run / "summary.json").read_text())
    reported = summary["final_metrics"]
    assert summary["finished"] and summary["final_eval"] and {"accuracy", "top2", "loss"} <= reported.keys()
    reference = _plain_torch_accuracy()
    assert reported["accuracy"] >= reference - 0.03, (reported, reference)

    out = tmp_path / "model.pt"
    done = subprocess.run([sys.executable, "-m", "dynabatch.cli.main", "export", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    task = load_task(SPEC)
    model = task.model()
    model.load_state_dict(torch.load(out))
    model.eval()
    test, collate = task.eval_data(), task.collate_fn()
    with torch.no_grad():
        x, y = collate([test[i] for i in range(len(test))])
        exported = float((model(x).argmax(-1) == y).float().mean())
    assert abs(exported - reported["accuracy"]) <= 0.005, (exported, reported)
