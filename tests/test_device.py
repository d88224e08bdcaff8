"""Worker `--device`: the model computes where it says, and a device this machine lacks is a clear startup error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness import Cluster

NO_CUDA = not torch.cuda.is_available()


def _worker(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynabatch.cli.main", "worker", *flags],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_exits_2_at_startup(device):
    out = _worker("--device", device, "--scheduler", "tcp://127.0.0.1:9")
    assert out.returncode == 2
    assert f"--device {device}: no CUDA device here" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x"])
def test_an_unknown_device_exits_2_naming_the_flag(device):
    out = _worker("--device", device)
    assert out.returncode == 2
    assert "--device" in out.stderr and "is not cpu, cuda or cuda:N" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no CUDA"))])
def test_worker_and_evaluator_compute_on_the_device(tmp_path, device):
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "cnn", "--epochs", "1000", "--eval-interval-s", "1"])
    try:
        c.scheduler()
        c.shard()
        worker = c.worker("a", "--device", device)
        evaluator = c.worker("ev", "--evaluator", "--device", device)
        c.wait_status("training and an evaluation on the device",
                      lambda s: s.workers and all(w.steps > 5 for w in s.workers.values())
                      and s.test_acc is not None and s.loss is not None)
        for p in (worker, evaluator):
            assert f"device {device}" in p.text(), p.text()
    finally:
        c.stop()
