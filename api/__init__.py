"""dynabatch: data-parallel PyTorch training for machines that are not equally fast.

    import dynabatch as db

    task = db.Task(model=make_model, train_data=lambda: MyDataset("train"), eval_data=lambda: MyDataset("test"),
                   optimizer=db.optim.SGD(lr=0.05, momentum=0.5), schedule=db.schedule.warmup_cosine(0.05))

then `dynabatch run --task path/to/file.py:task` (or `dynabatch worker --task ...` on each machine),
or from Python `run = db.run(task, workers=3, slowdowns=[1, 2, 4], epochs=5)`: `run.dir`, `run.summary`, `run.model`.
See README.md, "Train your own model" (a task file that runs as pasted), and docs/users.md for every field.

The names load on first use: every `dynabatch.*` module imports this package first,
and `dynabatch keys` or a role's flag error must not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Task": ("dynabatch.common.task", "Task"),
    "TaskError": ("dynabatch.common.task_error", "TaskError"),
    "Run": ("dynabatch.cluster.python_run", "Run"),
    "run": ("dynabatch.cluster.python_run", "run"),
    "metrics": ("dynabatch.common.eval_metrics", None),
    "optim": ("dynabatch.common.optim_spec", None),
    "schedule": ("dynabatch.common.schedules", None),
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'dynabatch' has no attribute {name!r}")
    module, attr = _NAMES[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)
