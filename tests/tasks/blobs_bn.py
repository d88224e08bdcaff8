"""The blobs task with BatchNorm: its running statistics must travel for evaluation to be right.

The features are the blobs of blobs.py in tiny raw units (a thousandth), which
the BatchNorm after the first layer normalises. In evaluation BatchNorm uses its
running statistics: with the job's estimate the model classifies the blobs; with
the factory's (mean 0, variance 1) the first layer's output is not normalised
at all, its biases drown the features, and the model is at chance.
"""

import dataclasses

from blobs import CLASSES, DIM, Blobs, accuracy, loss
from torch import nn

import dynabatch as db

SCALE = 1e-3


class RawBlobs(Blobs):
    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n, seed)
        self.x = self.x * SCALE


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))


task = db.Task(
    model=make_model,
    train_data=lambda: RawBlobs(3000, seed=1),
    eval_data=lambda: RawBlobs(1000, seed=2),
    loss=loss,
    metrics=[accuracy],
    optimizer=db.optim.SGD(lr=0.1, momentum=0.5),
)

# The same task for the delta protocols (local, msd), whose workers step with the job's SGD flags: it names none.
job_sgd = dataclasses.replace(task, optimizer=None)
