"""ResNet-18 with BatchNorm on CIFAR-10, as a dynabatch task.

    DYNABATCH_DATA_DIR=DIR dynabatch run --task examples/resnet18_cifar10.py:task --protocol asgd --slowdowns 1 2 4

Its recipe is CIFAR's usual one (Nesterov momentum 0.9, weight decay 5e-4, warm-up
cosine) at lr 0.05, for `--protocol asgd` (auto, the default, starts on asgd with the delay step, lr over the
staleness, and is not tuned for this recipe), where every worker's batch of
about B/n samples takes a step of its own: 0.05 is the usual 0.1 for 128 samples
scaled to a step of 64 (B = 192 over 3 workers). The usual 0.1 took a step per
worker twice as large as a synchronous one, and in the test's tiny setting (width
4, 600 images, 2 workers of 16 samples, 2 epochs) it ended at chance in 1 of 4 runs
on a loaded machine (a model stuck at loss ln 10 from its first quarter epoch:
nothing blows up, so no rollback follows); at 0.05 all 9 runs trained (41 to 73%).
Under `--protocol ssgd` (one step per B samples) it still trains, more slowly than
the synchronous recipe's lr 0.1 there (42% against 68%, one run each).

The CIFAR variant of ResNet-18 (a 3x3 stem and no max-pool, since the images are
32x32), written here without torchvision. CIFAR-10 is read from its python
batches (`data_batch_1..5`, `test_batch`) in `$DYNABATCH_DATA_DIR` or its
`cifar-10-batches-py/` subfolder, augmented with random crops and flips. Where the
files are absent the task trains on a synthetic CIFAR-shaped set instead (nothing
is downloaded): ten smooth coloured class templates, shifted, over noise; fixed
seeded, learnable, and not solved at a glance.

The task file is loaded by every worker process, so its knobs are environment
variables, which `dynabatch run` hands to the processes it starts:
  RESNET_WIDTH       channels of the first stage (64: ResNet-18; the stages have 1, 2, 4, 8 times it)
  RESNET_SYNTHETIC   training images of the synthetic set (10000; the test set is a fifth of it)
  DYNABATCH_DATA_DIR where CIFAR-10's python batches are
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dynabatch as db
from dynabatch.common.tasks.builtin_tasks import ImageSet
from dynabatch.common.tasks.data import Dataset, load_dataset

WIDTH = int(os.environ.get("RESNET_WIDTH", "64"))
SYNTHETIC_TRAIN = int(os.environ.get("RESNET_SYNTHETIC", "10000"))
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
SYNTHETIC_SEED = 2024


class Shortcut(nn.Module):
    """A strided 1x1 projection for the blocks that change shape; named `bn` so that `no_decay` finds it."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.conv(x))
        return out


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = Shortcut(c_in, c_out, stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """Four stages of two basic blocks (widths w, 2w, 4w, 8w), global average pooling, one linear layer."""

    def __init__(self, width: int = WIDTH, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, c_in = [], width
        for i in range(4):
            c_out = width * 2**i
            stages.append(nn.Sequential(BasicBlock(c_in, c_out, 1 if i == 0 else 2), BasicBlock(c_out, c_out, 1)))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stages(F.relu(self.bn1(self.conv1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
        return logits


def cifar_folder() -> Path | None:
    """The folder under $DYNABATCH_DATA_DIR holding all of CIFAR-10's python batches, if there is one."""
    root = os.environ.get("DYNABATCH_DATA_DIR")
    if not root:
        return None
    base = Path(root).expanduser()
    for folder in (base, base / "cifar-10-batches-py", base / "cifar10" / "cifar-10-batches-py"):
        if all((folder / f).is_file() for f in CIFAR_FILES):
            return folder
    return None


def synthetic_cifar(n_train: int = SYNTHETIC_TRAIN, seed: int = SYNTHETIC_SEED) -> Dataset:
    """Ten smooth colour templates over a shared background, shifted by up to 4 px, plus noise (uint8, 3x32x32).

    The shared background and the noise keep a class from being read off one
    pixel; the templates' shapes and colours make it learnable by a convolution.
    """
    g = torch.Generator().manual_seed(seed)
    smooth = F.interpolate(torch.rand(11, 3, 5, 5, generator=g), size=(40, 40), mode="bicubic", align_corners=False)
    templates = 255 * (0.6 * smooth[0] + 0.4 * smooth[1:])  # [10, 3, 40, 40]
    n = n_train + max(n_train // 5, 1)
    y = torch.randint(0, 10, (n,), generator=g)
    rows = torch.randint(0, 9, (n, 1), generator=g) + torch.arange(32)
    cols = torch.randint(0, 9, (n, 1), generator=g) + torch.arange(32)
    x = templates[
        y[:, None, None, None], torch.arange(3)[None, :, None, None], rows[:, None, :, None], cols[:, None, None, :]
    ]
    x = (x + 60 * torch.randn(n, 3, 32, 32, generator=g)).round_().clamp_(0, 255).to(torch.uint8)
    pixels = x[:n_train].float().div(255)
    mean = tuple(pixels.mean(dim=(0, 2, 3)).tolist())
    std = tuple(pixels.std(dim=(0, 2, 3)).tolist())
    return Dataset(
        "cifar10-synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:], mean, std, num_classes=10, augment=True
    )


_loaded: dict[str, Dataset] = {}


def images() -> Dataset:
    """CIFAR-10 if its files are there, else the synthetic set; read once per process."""
    if "all" not in _loaded:
        folder = cifar_folder()
        _loaded["all"] = load_dataset("cifar10", str(folder)) if folder else synthetic_cifar()
    return _loaded["all"]


task = db.Task(
    model=ResNet18,
    train_data=lambda: ImageSet(images(), train=True),
    eval_data=lambda: ImageSet(images(), train=False),
    metrics=[db.metrics.accuracy],
    optimizer=db.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, no_decay=("bn", "bias")),
    schedule=db.schedule.warmup_cosine(warmup=0.05),
    name="resnet18 on cifar10",
)
