"""The models a job can train, built deterministically from (name, input shape, seed).

Every worker and parameter server builds the same model independently and must get
bit-identical initial parameters, so construction is seeded without touching the
caller's global RNG. Parameters are registered in forward order (input layers first)
because parameter order is chunk priority order: the first chunks to arrive are the
ones the next forward pass needs first. No model has buffers, so the flat parameter
vector is the whole state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dynabatch.common.tasks.catalog import model_size
from dynabatch.common.tasks.data import NUM_CLASSES, input_shape
from dynabatch.common.wire.chunking import FLOAT_BYTES, travelling

if TYPE_CHECKING:
    from dynabatch.common.config import JobConfig


def _mlp(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Two 5x5 conv layers and two dense ones: past 90 % on Fashion-MNIST, cheap on a CPU."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (h // 4) * (w // 4), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class _Block(nn.Module):
    """Basic residual block; a parameter-free shortcut (stride-2 subsample, zero channels)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(c_out)
        self.stride, self.extra_channels = stride, c_out - c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            shortcut = nn.functional.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))
        return torch.relu(out + shortcut)


class ResNet(nn.Module):
    """CIFAR-style ResNet (He et al. 2016, section 4.2): widths 16/32/64, 6n+2 layers.

    GroupNorm replaces BatchNorm on purpose. BatchNorm's running statistics do travel
    (shard 0 averages them: ps/shared_buffers.py), but its batch statistics depend on
    each worker's batch size, which the scheduler changes per worker. GroupNorm
    normalizes each sample on its own, has no buffers, and behaves the same at any
    batch size.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, blocks_per_stage: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False), _norm(16), nn.ReLU())
        blocks, c_in = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(blocks_per_stage):
                blocks.append(_Block(c_in, width, stride=2 if stage > 0 and i == 0 else 1))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        logits: torch.Tensor = self.head(x.mean(dim=(2, 3)))
        return logits


class Flat(nn.Module):
    """One parameter vector of any size: the transport benchmarks' model.

    It makes a shard hold exactly N parameters, so push/pull throughput can be
    measured at 0.1M or 25M parameters. Its forward is a linear read-out of the
    mean pixel, enough to run a job end to end, not to learn anything useful.
    """

    def __init__(self, num_params: int, num_classes: int) -> None:
        super().__init__()
        if num_params < num_classes:
            raise ValueError(f"the flat model needs at least {num_classes} parameters")
        self.weight = nn.Parameter(torch.randn(num_params) * 0.01)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).mean(1, keepdim=True) * self.weight[: self.num_classes]


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, seed: int = 0) -> nn.Module:
    """Build a model whose initial parameters depend only on (name, input_shape, num_classes, seed);
    `name` is one of MODELS, or flat:N (common/tasks/catalog.py); ValueError for another.

    The CPU generator is seeded inside fork_rng, so the caller's RNG state is left
    exactly as it was (layers initialise on the CPU, so no other device is involved).
    """
    base, size = model_size(name)
    builders: dict[str, Callable[[], nn.Module]] = {
        "mlp": lambda: _mlp(input_shape, num_classes),
        "cnn": lambda: _cnn(input_shape, num_classes),
        "resnet": lambda: ResNet(input_shape, num_classes, blocks_per_stage=3),  # ResNet-20
        "flat": lambda: Flat(size, num_classes),
    }
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return builders[base]()


def model_for_job(job: JobConfig) -> nn.Module:
    """The job's model at its initial parameters; identical in every process of the job."""
    return build_model(job.model, input_shape(job.dataset), NUM_CLASSES, job.seed)


def model_wire_bytes(job: JobConfig) -> int:
    """The bytes of the job's model on the wire: one pull or push of its trainable parameters (`travelling`)."""
    return FLOAT_BYTES * sum(p.numel() for p in travelling(model_for_job(job)))
