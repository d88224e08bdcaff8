"""A task whose optimizer the shards do not apply: refused as its file is imported (test_task.py)."""

from torch import nn

import dynabatch as db

task = db.Task(model=lambda: nn.Linear(4, 2), train_data=list, optimizer=db.optim.OptimizerSpec(name="lion", lr=1e-4))
