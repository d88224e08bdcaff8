"""Worker `--device`: the model computes where it says, and a device this machine lacks is a clear startup error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hang_guard import hang_guard_s
from harness import Cluster

NO_CUDA = not torch.cuda.is_available()
GPU_FILE = re.compile(r"/dev/nvidia\d+")


def _nvidia_files_open(pid: int) -> set[str]:
    """The NVIDIA device files process `pid` holds open, as `lsof /dev/nvidia*` would list them.

    A process opens /dev/nvidiactl and its GPU's /dev/nvidiaN when it creates a CUDA
    context and keeps them while the context lives: a process that computes on a GPU
    holds one, a process that never touched a GPU holds none.
    """
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("/dev/nvidia"):
            found.add(target)
    return found


def _worker(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "worker", *flags],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_exits_2_at_startup(device: str) -> None:
    out = _worker("--device", device, "--scheduler", "tcp://127.0.0.1:9")
    assert out.returncode == 2
    assert f"--device {device}: no CUDA device here" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(NO_CUDA, reason="no CUDA")
def test_a_cuda_index_this_machine_lacks_exits_2_at_startup() -> None:
    device = f"cuda:{torch.cuda.device_count()}"
    out = _worker("--device", device, "--scheduler", "tcp://127.0.0.1:9")
    assert out.returncode == 2
    assert f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x"])
def test_an_unknown_device_exits_2_naming_the_flag(device: str) -> None:
    out = _worker("--device", device)
    assert out.returncode == 2
    assert "--device" in out.stderr and "is not cpu, cuda or cuda:N" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no CUDA"))])
def test_worker_and_evaluator_compute_on_the_device(tmp_path: Path, device: str) -> None:
    """Both train or evaluate, with their model's parameters where `--device` says (each logs the device its
    parameters are on, read off the model), and hold a GPU exactly when told to: a worker whose model is not on
    the device fails on any host, and on a GPU host so does a `cpu` worker that computed on the GPU anyway, or a
    `cuda` one that fell back to the CPU."""
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "cnn", "--epochs", "1000", "--eval-interval-s", "1"])
    try:
        c.scheduler()
        c.shard()
        worker = c.worker("a", "--device", device)
        evaluator = c.worker("ev", "--evaluator", "--device", device)
        c.wait_status(
            "training and an evaluation on the device",
            lambda s: (
                s.workers
                and all(w.steps > 5 for w in s.workers.values())
                and s.test_acc is not None
                and s.loss is not None
            ),
        )
        expected = torch.empty(0, device=device).device  # `cuda` -> cuda:0, the device a model moves to
        for p in (worker, evaluator):
            assert f"parameters on {expected}" in p.log_text(), p.log_text()[-2000:]
            held = _nvidia_files_open(p.proc.pid)
            if device == "cpu":
                assert not held, f"{p.name} runs with --device cpu yet holds {sorted(held)}"
            else:
                assert any(GPU_FILE.fullmatch(f) for f in held), f"{p.name} holds no GPU: {sorted(held)}"
    finally:
        c.stop()
