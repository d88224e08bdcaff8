"""The blobs task changed in one way each: a job started with blobs.py must refuse them."""

from blobs import CLASSES, DIM, Blobs, task
from torch import nn

import dynabatch as db

wider = db.Task(
    model=lambda: nn.Sequential(nn.Linear(DIM, 48), nn.ReLU(), nn.Linear(48, CLASSES)),
    train_data=task.train_data,
    eval_data=task.eval_data,
    loss=task.loss,
    metrics=task.metrics,
)
shorter = db.Task(
    model=task.model,
    train_data=lambda: Blobs(2000, seed=1),
    eval_data=task.eval_data,
    loss=task.loss,
    metrics=task.metrics,
)
