"""The blobs task trained by AdamW on the shards, biases without weight decay (`no_decay`)."""

from blobs import CLASSES, DIM, Blobs, accuracy, loss
from torch import nn

import dynabatch as db

task = db.Task(
    model=lambda: nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, CLASSES)),
    train_data=lambda: Blobs(3000, seed=1),
    eval_data=lambda: Blobs(1000, seed=2),
    loss=loss,
    metrics=accuracy,
    optimizer=db.optim.AdamW(lr=0.01, weight_decay=0.01, no_decay=("bias",)),
)
