"""Tests for dynabatch.common.tasks.models: shapes, determinism, no buffers, and that the cnn learns."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError
from dynabatch.common.tasks.catalog import MODELS
from dynabatch.common.tasks.data import SampleOrder, load_dataset, make_batch
from dynabatch.common.tasks.models import build_model

SHAPES = {"mlp": (1, 28, 28), "cnn": (1, 28, 28), "resnet": (3, 32, 32)}


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture
def threads() -> Iterator[None]:
    """Train on one thread, then restore the thread count: the suite runs two test processes on two
    cores, and torch's threads spinning against another process's made this test ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name,shape", list(SHAPES.items()) + [("cnn", (3, 32, 32)), ("mlp", (3, 30, 30))])
def test_forward_gives_one_logit_per_class(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, num_classes=7)
    out = model(torch.randn(5, *shape))
    assert out.shape == (5, 7) and out.dtype == torch.float32
    torch.autograd.backward(out.sum())
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", list(SHAPES))
def test_same_seed_same_parameters_and_global_rng_untouched(name: str) -> None:
    before = torch.get_rng_state()
    a, b = build_model(name, SHAPES[name], 10, seed=3), build_model(name, SHAPES[name], 10, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(flat(a), flat(b))
    assert not torch.equal(flat(a), flat(build_model(name, SHAPES[name], 10, seed=4)))


PARAMETER_DIGESTS = """
import hashlib, sys, torch
from dynabatch.common.tasks.models import build_model
for name, shape in eval(sys.argv[1]):
    model = build_model(name, shape, 10, seed=5)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
"""


def test_parameters_are_the_same_in_another_process() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PARAMETER_DIGESTS, repr(list(SHAPES.items()))],
        capture_output=True,
        text=True,
        check=True,
    )
    here = [
        hashlib.sha256(flat(build_model(name, shape, 10, seed=5)).numpy().tobytes()).hexdigest()
        for name, shape in SHAPES.items()
    ]
    assert out.stdout.split() == here


@pytest.mark.parametrize("name", list(SHAPES))
def test_models_have_no_buffers(name: str) -> None:
    model = build_model(name, SHAPES[name], 10)
    assert list(model.buffers()) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.modules())


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameters_are_in_forward_order(name: str) -> None:
    params = list(build_model(name, SHAPES[name], 10).parameters())
    first, last = params[0], params[-1]
    if name == "mlp":
        assert first.shape == (256, 28 * 28)
    else:  # the first conv reads the input channels
        assert first.dim() == 4 and first.shape[1] == SHAPES[name][0]
    assert last.shape == (10,), "the output layer's bias comes last"


def test_flat_model_holds_exactly_the_asked_parameters() -> None:
    model = build_model("flat:123457", (1, 28, 28), 10, seed=1)
    assert [p.numel() for p in model.parameters()] == [123_457]
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    again = build_model("flat:123457", (1, 28, 28), 10, seed=1)
    assert torch.equal(model.get_parameter("weight"), again.get_parameter("weight"))
    assert set(MODELS) == set(SHAPES) | {"flat"}


def test_unknown_model_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="mlp, cnn, resnet"):
        build_model("vgg", (1, 28, 28), 10)


@pytest.mark.parametrize(
    "name, error",
    [
        ("flat:many", "flat:N takes a whole number of parameters N >= 10"),
        ("flat:9", "flat:N takes a whole number of parameters N >= 10"),
        ("flat:", "flat:N takes a whole number"),
        ("cnn:100", "only the flat model takes a size"),
    ],
)
def test_a_model_size_only_the_flat_model_takes_and_only_as_a_count(name: str, error: str) -> None:
    """The flat model's size is part of its name: the job's --model alone says what every worker builds."""
    with pytest.raises(ConfigError, match=f"^--model: '{name}': {error}"):
        JobConfig(model=name).validate()
    JobConfig(model="flat:10").validate()


def test_cnn_learns_synthetic(threads: None) -> None:
    ds = load_dataset("synthetic")
    model = build_model("cnn", ds.input_shape, ds.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    test_x, test_y = make_batch(ds, torch.arange(len(ds.test_y)), train=False)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(test_x).argmax(1) == test_y).float().mean())

    assert accuracy() < 0.3, "synthetic data should not be solved by an untrained model"
    order, gen = SampleOrder(len(ds.train_y), seed=0), torch.Generator().manual_seed(0)
    for _ in range(150):  # seeded: 0.92 after 150 steps
        x, y = make_batch(ds, order.take(64), train=True, generator=gen)
        opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(model(x), y))
        opt.step()
    assert accuracy() > 0.85
