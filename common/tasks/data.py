"""Datasets read from their standard files, decoded once into uint8 tensors.

The whole set stays in memory as uint8 (Fashion-MNIST: 55 MB, a quarter of float32)
and every batch is sliced, converted, normalized and augmented with tensor
operations, so feeding a worker costs far less than its forward pass.
"""

from __future__ import annotations

import math
import mmap
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dynabatch.common.tasks.catalog import DATASETS
from dynabatch.common.tasks.dataset_files import (
    CIFAR_FILES,
    IDX_FILES,
    check_images_and_labels,
    find_dataset,
    idx_content,
    idx_file,
)

_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "synthetic": ((0.4985,), (0.2919,)),  # of its training images, as the others'; not computed at each start
}


@dataclass(frozen=True)
class Dataset:
    """A whole dataset in memory: uint8 images [N, C, H, W] and int64 labels [N]."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: tuple[float, ...]  # per channel, in [0, 1] units
    std: tuple[float, ...]
    num_classes: int
    augment: bool  # random 4px-padded crop + horizontal flip on training batches

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one sample, which is what a model is built for."""
        c, h, w = self.train_x.shape[1:]
        return (c, h, w)


def read_idx(path: Path) -> torch.Tensor:
    """Decode one uint8 idx file (plain or .gz) into a tensor of its declared shape; BadDatasetFile
    (dataset_files.idx_content) naming the file if it does not decode."""
    raw, dims, start = idx_content(path)
    buffer = raw if isinstance(raw, mmap.mmap) else bytearray(raw)  # a copy-on-write map is writable as it is
    data = torch.frombuffer(buffer, dtype=torch.uint8, offset=start, count=math.prod(dims))
    return data.reshape(dims)


def _load_idx(folder: Path) -> tuple[torch.Tensor, ...]:
    tr_x, tr_y, te_x, te_y = (read_idx(idx_file(folder, stem) or folder / stem) for stem in IDX_FILES)
    for x, y, stem in ((tr_x, tr_y, "train"), (te_x, te_y, "t10k")):
        check_images_and_labels(folder, stem, list(x.shape), list(y.shape))
    return tr_x.unsqueeze(1), tr_y.long(), te_x.unsqueeze(1), te_y.long()


def _load_cifar(folder: Path) -> tuple[torch.Tensor, ...]:
    """Read the python-pickle batches. Pickle runs code: only point this at files you trust."""
    parts = []
    for names in (CIFAR_FILES[:-1], CIFAR_FILES[-1:]):
        xs, ys = [], []
        for f in names:
            with open(folder / f, "rb") as fh:
                batch = pickle.load(fh, encoding="bytes")
            xs.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8).reshape(-1, 3, 32, 32))
            ys.append(torch.as_tensor(batch[b"labels"], dtype=torch.int64))
        parts += [torch.cat(xs), torch.cat(ys)]
    return tuple(parts)


def _synthetic(n_train: int = 12000, n_test: int = 2000) -> tuple[torch.Tensor, ...]:
    """Ten smooth class templates over a shared background, shifted by up to 3 px, plus noise.

    The shared background and the noise keep it from being solved at a glance (a small
    CNN needs a couple of epochs to pass 90 %), yet it is learnable and fixed-seeded.
    """
    g = torch.Generator().manual_seed(1234)
    smooth = F.interpolate(
        torch.rand(11, 1, 7, 7, generator=g), size=(28, 28), mode="bicubic", align_corners=False
    ).squeeze(1)
    templates = 255 * (0.75 * smooth[0] + 0.25 * smooth[1:])  # [10, 28, 28]
    padded = F.pad(templates.unsqueeze(1), (3, 3, 3, 3), mode="replicate").squeeze(1)
    n = n_train + n_test
    y = torch.randint(0, 10, (n,), generator=g)
    rows = torch.randint(0, 7, (n,), generator=g)
    cols = torch.randint(0, 7, (n,), generator=g)
    shifted = padded.unfold(1, 28, 1).unfold(2, 28, 1)  # [10, 7, 7, 28, 28]: every shift of every template, a view
    x = torch.randn(n, 28, 28, generator=g).mul_(70).add_(shifted[y, rows, cols]).round_().clamp_(0, 255)
    x = x.to(torch.uint8).unsqueeze(1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load a whole dataset into memory; dataset_files.find_dataset says where its files are looked for."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "synthetic":
        tr_x, tr_y, te_x, te_y = _synthetic()
    else:
        folder = find_dataset(name, data_dir)
        tr_x, tr_y, te_x, te_y = _load_cifar(folder) if name == "cifar10" else _load_idx(folder)
    mean, std = _STATS[name]
    return Dataset(name, tr_x, tr_y, te_x, te_y, mean, std, num_classes=10, augment=name == "cifar10")


def _random_crop_flip(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Per sample: a random crop of the 4 px zero-padded image, mirrored half the time.

    Two gathers over the whole batch (rows, then columns; a flip is just reversed
    column indices) instead of a Python loop over samples.
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n, 1), generator=generator)
    dx = torch.randint(0, 9, (n, 1), generator=generator)
    flip = torch.rand(n, 1, generator=generator) < 0.5
    rows = (dy + torch.arange(h)).view(n, 1, h, 1).expand(n, c, h, w + 8)
    cols = dx + torch.where(flip, torch.arange(w - 1, -1, -1), torch.arange(w))
    return padded.gather(2, rows).gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))


def make_batch(
    ds: Dataset, indices: torch.Tensor, train: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice samples from the train (or test) split into a normalized float32 batch.

    Only training batches of datasets with `augment` set are augmented (on uint8,
    before conversion, which moves a quarter of the bytes); evaluation sees plain images.
    """
    source_x, source_y = (ds.train_x, ds.train_y) if train else (ds.test_x, ds.test_y)
    x = source_x[indices]
    if train and ds.augment:
        x = _random_crop_flip(x, generator)
    mean = torch.tensor(ds.mean).view(1, -1, 1, 1)
    std = torch.tensor(ds.std).view(1, -1, 1, 1)
    return (x.float().div_(255) - mean) / std, source_y[indices]


class SampleOrder:
    """A worker's own shuffled order over the whole training set (seeded), reshuffled each pass.

    Each worker draws from its own permutation instead of a shard so that any batch
    size, and workers joining or leaving, still sample the whole set uniformly.
    """

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise ValueError(f"SampleOrder needs a non-empty dataset, got n={n}")
        self._n = n
        self._generator = torch.Generator().manual_seed(seed)
        self._perm = torch.randperm(n, generator=self._generator)
        self._pos = 0

    def take(self, count: int) -> torch.Tensor:
        """The next `count` indices (int64); a pass that ends continues in a fresh permutation."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        parts = [torch.empty(0, dtype=torch.int64)]
        while count > 0:
            if self._pos == self._n:
                self._perm = torch.randperm(self._n, generator=self._generator)
                self._pos = 0
            k = min(count, self._n - self._pos)
            parts.append(self._perm[self._pos : self._pos + k])
            self._pos += k
            count -= k
        return torch.cat(parts)


INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "synthetic": (1, 28, 28),
    "mnist": (1, 28, 28),
    "fashion-mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
}
"""(C, H, W) of each built-in dataset's images, known without reading them: what the
built-in models are built for. Sizes are not here: they come from the data itself."""
NUM_CLASSES = 10


def input_shape(name: str) -> tuple[int, int, int]:
    if name not in INPUT_SHAPES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return INPUT_SHAPES[name]
