"""A task written only against the public API, as a user would: `import dynabatch as db`.

An MLP on a small dataset of its own (Gaussian blobs, dict batches), with its own
collate, loss and metric, SGD with a warm-up cosine schedule and clipping. The
data is generated from a fixed seed, so every process builds the same set.
"""

import torch
from torch import nn

import dynabatch as db

CLASSES, DIM = 4, 16


class Blobs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0)) * 2.0
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, DIM, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "label": self.y[i]}


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["features"]), batch["label"])


def top2(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    hits = (model(batch["features"]).topk(2, dim=-1).indices == batch["label"][:, None]).any(dim=-1)
    return {"top2": (float(hits.sum()), float(len(hits)))}


def accuracy(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    correct = (model(batch["features"]).argmax(-1) == batch["label"]).sum()
    return {"accuracy": (float(correct), float(len(batch["label"])))}


task = db.Task(
    model=make_model,
    train_data=lambda: Blobs(3000, seed=1),
    eval_data=lambda: Blobs(1000, seed=2),
    loss=loss,
    metrics=[accuracy, top2],
    optimizer=db.optim.SGD(lr=0.1, momentum=0.5),
    schedule=db.schedule.warmup_cosine(warmup=0.1),
    clip_grad_norm=5.0,
)
