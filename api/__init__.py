"""dynabatch: data-parallel PyTorch training for machines that are not equally fast.

    import dynabatch as db

    task = db.Task(model=make_model, train_data=lambda: MyDataset("train"), eval_data=lambda: MyDataset("test"),
                   optimizer=db.optim.SGD(lr=0.05, momentum=0.5), schedule=db.schedule.warmup_cosine(0.05))

then `dynabatch run --task path/to/file.py:task` (or `dynabatch worker --task ...` on each machine),
or from Python `run = db.run(task, workers=3, slowdowns=[1, 2, 4], epochs=5)`: `run.dir`, `run.summary`, `run.model`.
See README.md, "Train your own model" (a task file that runs as pasted), and docs/users.md for every field.

The public names, the whole promise to users (everything else under dynabatch.* is internal):

- `Task`: what is trained (model factory, data, collate, loss, metrics, optimizer, schedule, clip_grad_norm).
- `TaskError`: a task that cannot be trained, with what to fix.
- `optim`: the shards' optimizer, `optim.SGD`, `optim.Adam`, `optim.AdamW` (`optim.OptimizerSpec` their base).
- `schedule`: the learning rate against the job's progress, `schedule.constant`, `schedule.warmup_cosine`,
  `schedule.step`.
- `metrics`: evaluation metrics, each (model, batch) -> {name: (sum, count)}; `metrics.accuracy`.
- `run(task, workers=3, slowdowns=(1, 2, 4), **job_flags) -> Run`: `dynabatch run` from Python;
  `Run` (`dir`, `summary`, `model`), `RunFailed` when the job does not finish, `ConfigError` for a setting that
  cannot work (of the wrong type, out of its bounds, unknown), before anything starts.
- `export(run_dir, task_spec="", task=None) -> nn.Module`: the model a finished run trained (`dynabatch export`);
  `ExportError` for a folder whose model cannot be assembled.

The names load on first use: every `dynabatch.*` module imports this package first,
and `dynabatch keys` or a role's flag error must not wait for torch. The api/ folder
imports no role: `run`, `Run`, `RunFailed`, `export` and `ExportError` belong to the
launcher (dynabatch.cluster) and are looked up only when first used (tests/test_layering.py).
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> (module, attribute); None: the module itself.
_NAMES = {
    "Task": ("dynabatch.task", "Task"),
    "TaskError": ("dynabatch.task_error", "TaskError"),
    "ConfigError": ("dynabatch.common.flags", "ConfigError"),
    "metrics": ("dynabatch.metrics", None),
    "optim": ("dynabatch.optim", None),
    "schedule": ("dynabatch.schedule", None),
    "Run": ("dynabatch.cluster.python_run", "Run"),
    "RunFailed": ("dynabatch.cluster.python_run", "RunFailed"),
    "run": ("dynabatch.cluster.python_run", "run"),
    "ExportError": ("dynabatch.cluster.export", "ExportError"),
    "export": ("dynabatch.cluster.export", "trained_model"),
}
# A literal, as tools read it without running this file; tests/test_layering.py keeps it equal to _NAMES.
__all__ = [
    "ConfigError",
    "ExportError",
    "Run",
    "RunFailed",
    "Task",
    "TaskError",
    "export",
    "metrics",
    "optim",
    "run",
    "schedule",
]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'dynabatch' has no attribute {name!r}")
    module, attr = _NAMES[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    """The public names only: the submodules that importing them loads (dynabatch.common, ...) are internal."""
    return list(__all__)
