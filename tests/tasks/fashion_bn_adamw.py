"""The issue's own acceptance task, written only against the public API as a user elsewhere would:
an MLP with BatchNorm on a small Fashion-MNIST subset, AdamW with `no_decay`, a warm-up cosine
schedule and a metric of its own (top-2 accuracy).

The data is read from the Debian package's idx files (apt-get install dataset-fashion-mnist).
"""

import gzip
from pathlib import Path

import torch
from torch import nn

import dynabatch as db

FOLDER = Path("/usr/share/datasets/fashion-mnist")
TRAIN, TEST = 6000, 2000


def _idx(name: str) -> torch.Tensor:
    raw = gzip.decompress((FOLDER / f"{name}.gz").read_bytes())
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(raw[3])]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=4 + 4 * raw[3]).reshape(dims)


class Subset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The first `n` images of a split, as flat float vectors in [0, 1]."""

    def __init__(self, split: str, n: int) -> None:
        self.x = _idx(f"{split}-images-idx3-ubyte")[:n].reshape(n, -1).float() / 255
        self.y = _idx(f"{split}-labels-idx1-ubyte")[:n].long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


def top2(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[float, float]]:
    x, y = batch
    hits = (model(x).topk(2, dim=-1).indices == y[:, None]).any(dim=-1)
    return {"top2": (float(hits.sum()), float(len(y)))}


task = db.Task(
    model=make_model,
    train_data=lambda: Subset("train", TRAIN),
    eval_data=lambda: Subset("t10k", TEST),
    metrics=[db.metrics.accuracy, top2],
    optimizer=db.optim.AdamW(lr=0.003, weight_decay=0.01, no_decay=("bias", "1.")),
    schedule=db.schedule.warmup_cosine(warmup=0.1),
)
