"""One task, honest and Byzantine: the same model and data, and a loss that lies in a worker started with it.

`honest` is the blobs task without gradient clipping (a Byzantine worker does not
clip its own lie). `scaled`, `flipped` and `noise` are what issue 22 tried as an
authenticated attacker: the gradient times 1e3, its sign flipped, and replaced by
noise of about 400 times the honest norm; `flipped_large` is flipped and times 3,
within the norm bound. They share the model, its signature and
the optimizer, so the shards take the attacker's INIT and pushes as a worker's.
"""

from collections.abc import Callable

import torch
from blobs import Blobs, accuracy, loss, make_model
from torch import nn

import dynabatch as db

NOISE_STD = 30.0  # per value; the model's ~700 parameters give a norm of about 800, the honest one about 1-2


def _task(lossfn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]) -> db.Task:
    return db.Task(
        model=make_model,
        train_data=lambda: Blobs(3000, seed=1),
        eval_data=lambda: Blobs(1000, seed=2),
        loss=lossfn,
        metrics=[accuracy],
        optimizer=db.optim.SGD(lr=0.1, momentum=0.5),
    )


def _noise(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss whose gradient is noise: the honest loss' value with each parameter's gradient replaced."""
    honest = loss(model, batch)
    lie = sum(((p * torch.randn_like(p) * NOISE_STD).sum() for p in model.parameters()), torch.zeros(()))
    return honest.detach() + lie - lie.detach()


honest = _task(loss)
scaled = _task(lambda model, batch: loss(model, batch) * 1e3)
flipped = _task(lambda model, batch: -loss(model, batch))
# Sign-flipped and as large as the shards' norm bound lets through unclipped (--gradient-bound 4): one such worker
# outweighs two honest ones, so without a direction check the model climbs the loss.
flipped_large = _task(lambda model, batch: -3.0 * loss(model, batch))
noise = _task(_noise)
