"""Tasks that are wrong in one way each, for the start-up checks."""

import torch
from torch import nn

import dynabatch as db

data = lambda: torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))  # noqa: E731


class Unseeded(nn.Module):
    """Draws its initial weights from a generator the job's seed does not control."""

    def __init__(self) -> None:
        super().__init__()
        unseeded = torch.Generator()
        unseeded.seed()  # 64 bits from the OS: two builds agree with odds 2**-64, not the 1/1000 of a seed % 1000
        self.weight = nn.Parameter(torch.randn(2, 4, generator=unseeded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


not_a_task = {"model": nn.Linear}
unseeded = db.Task(model=Unseeded, train_data=data)
empty = db.Task(model=lambda: nn.Linear(4, 2), train_data=lambda: torch.utils.data.TensorDataset(torch.zeros(0, 4)))
vector_loss = db.Task(
    model=lambda: nn.Linear(4, 2),
    train_data=data,
    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none"),
)
float64 = db.Task(model=lambda: nn.Linear(4, 2).double(), train_data=data)
empty_eval = db.Task(
    model=lambda: nn.Linear(4, 2),
    train_data=data,
    eval_data=lambda: torch.utils.data.TensorDataset(torch.zeros(0, 4), torch.zeros(0)),
)
float_metric = db.Task(model=lambda: nn.Linear(4, 2), train_data=data, eval_data=data, metrics=lambda model, batch: 0.5)
no_grad_loss = db.Task(
    model=lambda: nn.Linear(4, 2),
    train_data=data,
    eval_data=data,
    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]).detach(),
)
no_eval = db.Task(model=lambda: nn.Linear(4, 2), train_data=data)
