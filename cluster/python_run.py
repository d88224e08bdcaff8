"""`db.run(task, workers=3, slowdowns=[1, 2, 4], **job_flags)`: `dynabatch run` from Python.

    import dynabatch as db
    from my_task import task

    if __name__ == "__main__":
        run = db.run(task, workers=3, slowdowns=[1, 2, 4], epochs=5, global_batch=128)
        print(run.summary["final_metrics"], run.dir)
        run.model  # the trained nn.Module

Workers and the evaluator are processes of their own that load the task by name,
as `--task` does. So `task` is a spec string (`"file.py:attr"`, `"pkg.module:attr"`)
or a Task at module level in a file they can import: it is found among the loaded
modules (a task in the script being run is found through the script's path). A
task built inside a function, or typed into an interactive session, has no name
and is refused. Those processes import the file again, as `multiprocessing` does:
a script that calls `db.run` at module level must do so under
`if __name__ == "__main__":`; a nested call is refused rather than starting a job
per worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dynabatch.cluster.export import trained_model
from dynabatch.cluster.main import JobRun, job_flags, prepare, settle
from dynabatch.cluster.options import RunOptions
from dynabatch.common.config import JobConfig, job_from_dict
from dynabatch.common.flags import ConfigError, typed_values
from dynabatch.common.net.curve import CurveKeys, CurveOptions
from dynabatch.common.planning.auto_protocol import resolved
from dynabatch.task import Task
from dynabatch.task_error import TaskError

ACTIVE_ENV = "_DYNABATCH_DB_RUN"  # set while db.run runs; its processes inherit it (not a DYNABATCH_ flag default)


@dataclass
class Run:
    """A finished run: its folder, its summary.json, and the trained model."""

    dir: Path
    summary: dict[str, Any]
    model: torch.nn.Module


class RunFailed(RuntimeError):
    """The job did not finish (a process failed, it timed out, or it was interrupted); the run folder says why."""


def _spec_in(name: str, module: ModuleType, attr: str) -> str | None:
    """How a worker names `module.attr`: by file for a script or a top-level module (a file the workers
    import from any folder, its neighbours with it), by dotted path for a module inside a package."""
    path = getattr(module, "__file__", None)
    if "." not in name:
        return f"{Path(path).resolve()}:{attr}" if path and path.endswith(".py") else None
    return f"{name}:{attr}"


def task_spec(task: Task | str) -> str:
    """The `--task` spec that names `task` for the job's processes; TaskError if it has none."""
    if isinstance(task, str):
        return task
    if not isinstance(task, Task):
        raise TaskError(f"db.run: task is a {type(task).__name__}, not a dynabatch.Task or a 'file.py:attr' spec")
    script = sys.modules.get("__main__")  # also listed as __mp_main__ once multiprocessing is imported
    found: list[tuple[bool, str]] = []
    for name, module in list(sys.modules.items()):
        if module is None or name == "dynabatch" or name.startswith("dynabatch."):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is task:
                spec = _spec_in(name, module, attr)
                if spec is not None:
                    found.append((module is script, spec))  # the defining module before the script importing it
    if not found:
        raise TaskError(
            "db.run: the task is not a module-level attribute of any imported file; the workers are "
            "separate processes that load it by name: define it at module level in a .py file "
            "(calling db.run under `if __name__ == \"__main__\":`), or pass 'file.py:attr'"
        )
    return min(found)[1]


def settings(
    spec: str, workers: int, slowdowns: Sequence[float | str], flags: dict[str, Any]
) -> tuple[RunOptions, JobConfig, CurveOptions]:
    """`dynabatch run`'s settings from keyword arguments named as its flags (`global_batch=64`); ConfigError."""
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (RunOptions, JobConfig, CurveOptions)}
    unknown = sorted(set(flags) - set().union(*names.values()))
    if unknown:
        raise ConfigError(
            f"db.run: no setting {', '.join(unknown)} (the flags of `dynabatch run --help`, with _ for -)"
        )
    if isinstance(slowdowns, (str, bytes)) or not isinstance(slowdowns, Sequence):
        raise ConfigError(f"db.run: slowdowns={slowdowns!r} is not a list of factors, one or one per worker: [1, 2, 4]")
    part = {cls: {k: v for k, v in flags.items() if k in names[cls]} for cls in names}
    given = {"workers": workers, "slowdowns": [str(s) for s in slowdowns], "task": spec, **part[RunOptions]}
    opts = RunOptions(**typed_values(RunOptions, given, "db.run:")).anchored()
    job, _ = resolved(settle(opts, job_from_dict(part[JobConfig], allow_auto=True)))
    return opts, job, CurveOptions(**typed_values(CurveOptions, part[CurveOptions], "db.run:"))


def run(task: Task | str, workers: int = 3, slowdowns: Sequence[float | str] = (1, 2, 4), **flags: Any) -> Run:
    """Do what `dynabatch run` does and return the finished run with its trained model.

    TaskError (a task that cannot be named or cannot train, or --init weights that
    do not fit it) and ConfigError (a bad setting) before anything starts;
    RunFailed if the job does not finish.
    """
    if os.environ.get(ACTIVE_ENV):
        raise TaskError(
            "db.run was called while a job's process loaded the task: call it under "
            '`if __name__ == "__main__":` in the file that defines the task'
        )
    spec = task_spec(task)
    opts, job, curve = settings(spec, workers, slowdowns, flags)
    keys = CurveKeys.load(curve.curve_dir, "run") if curve.curve_dir else None
    os.environ[ACTIVE_ENV] = "1"
    try:
        run_dir = prepare(opts, job)
        code = JobRun(opts, job, job_flags(job), run_dir, curve.curve_dir, keys).execute()
    finally:
        del os.environ[ACTIVE_ENV]
    summary = json.loads((run_dir / "summary.json").read_text())
    if code != 0:
        why = summary.get("error") or summary.get("failed") or "see the logs"  # failed: it diverged, or stalled
        raise RunFailed(f"the job did not finish ({why}; logs in {run_dir / 'logs'})")
    return Run(run_dir, summary, trained_model(run_dir, task=task if isinstance(task, Task) else None))
