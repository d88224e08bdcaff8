"""`dynabatch check`: the offline dry run of a task (parameters, chunks, kept state, step time, bytes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from dynabatch.cluster import check_command
from dynabatch.cluster.dry_run import (
    COUNTER_POLICY,
    FIXED_BUFFER_POLICY,
    FROZEN_POLICY,
    TRAINED_BUFFER_POLICY,
    dry_run,
)
from dynabatch.common.config import JobConfig
from dynabatch.common.planning.line_fit import fit_line
from dynabatch.task import Task
from hang_guard import hang_guard_s
from harness import child_env, command_line

TASKS = Path(__file__).resolve().parent / "tasks"


@pytest.mark.slow
def test_check_lists_the_parameters_and_layout_and_fits_a_positive_per_sample_cost() -> None:
    done = subprocess.run(
        command_line(
            "check",
            [
                "--task",
                f"{TASKS / 'blobs.py'}:task",
                "--batches",
                "16",
                "1024",
                "--repeats",
                "7",
                "--shards",
                "2",
                "--chunk-bytes",
                "1024",
            ],
        ),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "same initial parameters: yes" in out and "training set: 3000 samples" in out
    rows = re.findall(r"^  (\S+)\s+(\[[\d, ]*\])\s+([\d,]+)$", out, re.M)
    assert rows == [
        ("0.weight", "[32, 16]", "512"),
        ("0.bias", "[32]", "32"),
        ("2.weight", "[4, 32]", "128"),
        ("2.bias", "[4]", "4"),
    ], out
    assert "676 values, 2,704 bytes" in out and "3 chunk(s)" in out
    assert "shard 0: 2 chunk(s) [0, 2]" in out and "shard 1: 1 chunk(s) [1]" in out
    assert "frozen parameters: none" in out and "buffers: none" in out
    fit = re.search(r"c = (-?[\d.]+) us/sample", out)
    assert fit is not None, out
    per_sample_us = float(fit.group(1))
    assert per_sample_us > 0, out
    assert "bytes per step and worker: 5,408 (pull 2,704 + push 2,704)" in out


def test_check_gives_frozen_parameters_and_buffers_their_policy() -> None:
    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        m[0].requires_grad_(False)
        m.register_buffer("scale", torch.ones(2))
        return m

    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    report = dry_run(Task(model=model, train_data=lambda: data), JobConfig(), batches=(4, 8), repeats=1)
    assert [p.name for p in report.signature.params] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert [(k.name, k.policy) for k in report.frozen] == [("0.weight", FROZEN_POLICY), ("0.bias", FROZEN_POLICY)]
    policies = {k.name: k.policy for k in report.buffers}
    assert policies == {
        "scale": FIXED_BUFFER_POLICY,
        "1.running_mean": TRAINED_BUFFER_POLICY,
        "1.running_var": TRAINED_BUFFER_POLICY,
        "1.num_batches_tracked": COUNTER_POLICY,
    }
    assert report.bytes_per_step == 2 * 4 * (3 + 3 + 6 + 2) and set(report.step_s) == {4, 8}


def test_check_refuses_a_bad_task_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_command.main(["--task", f"{TASKS / 'bad.py'}:unseeded"]) == 2
    assert "dynabatch check: two builds of the model differ in weight" in capsys.readouterr().err


def test_a_line_fit_recovers_fixed_and_per_sample_cost() -> None:
    a, c = fit_line([(16, 0.002 + 16e-4), (64, 0.002 + 64e-4), (256, 0.002 + 256e-4)])
    assert a == pytest.approx(0.002) and c == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([(16, 1.0), (16, 2.0)])
