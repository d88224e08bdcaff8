"""A task whose optimizer cannot train: refused as its file is imported (test_task.py)."""

from torch import nn

import dynabatch as db

task = db.Task(model=lambda: nn.Linear(4, 2), train_data=list, optimizer=db.optim.Adam(lr=-1e-3))
