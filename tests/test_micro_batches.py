"""`--micro-batch`: an assigned batch run as several passes gives the whole batch's gradient and loss."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import torch

from dynabatch.task import cross_entropy
from dynabatch.worker.micro_batches import micro_batches, slice_batch
from dynabatch.worker.trainer import train_step
from harness import Cluster, wait_for


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 12, generator=gen), torch.randint(0, 5, (n,), generator=gen)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    grads = []
    for p in model.parameters():
        assert p.grad is not None, "a backward pass gives every parameter a gradient"
        grads.append(p.grad.reshape(-1))
    return torch.cat(grads)


@pytest.mark.parametrize("micro", [1, 7, 16, 49, 50, 64])
def test_accumulated_passes_give_the_full_batch_gradient_and_loss(micro: int) -> None:
    model, batch = _model(), _batch(50)
    full_loss = train_step(model, batch, cross_entropy)
    full = _grads(model).clone()
    model.zero_grad()
    loss = train_step(model, batch, cross_entropy, micro_batch=micro)
    assert torch.allclose(_grads(model), full, atol=1e-6, rtol=0)
    assert loss == pytest.approx(full_loss, abs=1e-6)
    assert full.abs().max() > 1e-3, "the gradient compared is not trivially zero"


def test_clipping_applies_to_the_accumulated_gradient() -> None:
    model, batch = _model(), _batch(50)
    train_step(model, batch, cross_entropy, clip_grad_norm=0.01)
    clipped = _grads(model).clone()
    assert clipped.norm() == pytest.approx(0.01, rel=1e-4)
    train_step(model, batch, cross_entropy, clip_grad_norm=0.01, micro_batch=16)
    assert torch.allclose(_grads(model), clipped, atol=1e-7, rtol=0)


def test_passes_cover_the_batch_in_order_with_shares_summing_to_one() -> None:
    x = torch.arange(10)
    parts = list(micro_batches(x, 4))
    assert [p.tolist() for p, _ in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [s for _, s in parts] == [0.4, 0.4, 0.2]
    ((whole, share),) = micro_batches(x, 0)
    assert whole is x and share == 1.0
    ((whole, share),) = micro_batches(x, 10)
    assert whole is x and share == 1.0


def test_every_per_sample_value_of_a_collated_batch_is_sliced_and_nothing_else() -> None:
    Pair = namedtuple("Pair", "x y")
    n = 6
    batch = {
        "pair": Pair(torch.zeros(n, 3), torch.arange(n)),
        "text": [f"s{i}" for i in range(n)],
        "shared": torch.ones(2, 2),
        "scale": 0.5,
        "ids": (torch.arange(n),),
    }
    part = slice_batch(batch, 2, 5, n)
    assert isinstance(part["pair"], Pair) and part["pair"].x.shape == (3, 3) and part["pair"].y.tolist() == [2, 3, 4]
    assert part["text"] == ["s2", "s3", "s4"]
    assert part["shared"].shape == (2, 2) and part["scale"] == 0.5
    assert isinstance(part["ids"], tuple) and part["ids"][0].tolist() == [2, 3, 4]


@pytest.mark.slow
def test_a_micro_batching_worker_is_refused_by_a_pipelined_job_and_exits_2(tmp_path: Path) -> None:
    """The pipelined step pushes each chunk's gradient during backward: it cannot accumulate passes."""
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp", "--pipeline", "on", "--epochs", "1000"])
    try:
        c.scheduler()
        c.shard(0)
        worker = c.worker("small", "--micro-batch", "16")
        wait_for("the worker to exit", lambda: worker.proc.poll() is not None, 60)
        assert worker.proc.returncode == 2
        assert "--micro-batch 16: job 'dynabatch' runs with --pipeline on" in worker.log_text(), worker.log_text()
        assert "Traceback" not in worker.log_text()
    finally:
        c.stop()
