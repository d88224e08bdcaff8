"""A user's task loaded by `--task path/to/file.py:attr` or `--task pkg.module:attr`, and checked.

Everything that can be wrong with it (it does not import, it is not a Task, its
model is not reproducible, its data is empty, its loss is not a scalar, its
parameters are of a dtype that cannot travel) is a `TaskError` with one clear
message, found before any process starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from dynabatch.common.tasks.task_spec import names_a_file, split_task_spec
from dynabatch.common.wire.chunking import named_travelling
from dynabatch.common.wire.model_signature import ModelSignature, running_buffers, signature
from dynabatch.optim import optimizer_from_fields
from dynabatch.task import Task
from dynabatch.task_error import TaskError


def load_task(spec: str) -> Task:
    """The Task named by `file.py:attr` or `pkg.module:attr` (a Task, or a function returning one)."""
    where, attr = split_task_spec(spec)
    try:
        module = _import_file(where) if names_a_file(where) else importlib.import_module(where)
    except TaskError:
        raise
    except BaseException as exc:  # a user's module may raise anything, SystemExit included
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise TaskError(f"--task {spec!r}: importing {where} failed: {detail}") from None
    if not hasattr(module, attr):
        raise TaskError(f"--task {spec!r}: {where} has no attribute {attr!r}")
    task = getattr(module, attr)
    if callable(task) and not isinstance(task, Task):
        try:
            task = task()
        except Exception as exc:
            raise TaskError(f"--task {spec!r}: calling {attr}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(task, Task):
        raise TaskError(f"--task {spec!r}: {attr} is a {type(task).__name__}, not a dynabatch.Task")
    task.name = spec
    return task


def _import_file(path_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise TaskError(f"--task: no file {path}")
    name = f"dynabatch_task_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"--task: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # a task file may import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


class CheckedTask(NamedTuple):
    """What `check_task` found: the model's signature, the training set it built, the metrics' names."""

    signature: ModelSignature
    train_data: Any
    metric_names: tuple[str, ...]


def check_task(task: Task, seed: int) -> CheckedTask:
    """Everything that can be checked without a job: reproducible model, non-empty training and evaluation
    data, a scalar loss with a gradient, metrics of the documented shape.

    Builds the model twice (the same seed must give the same parameters), takes a
    batch of two samples and runs the loss and a backward pass on it; the buffers
    that this training forward changed are the ones that travel (`running_buffers`).
    Every metric runs on a batch of two evaluation samples (training ones for a task without
    evaluation data). The names it returns are the evaluation's: `loss` and each metric's.
    """
    first, second = task.build_model(seed), task.build_model(seed)
    sig = signature(first, 0)
    for (name, a), (_, b) in zip(named_travelling(first), named_travelling(second), strict=False):
        if not torch.equal(a, b):
            raise TaskError(
                f"two builds of the model differ in {name}: its construction uses randomness "
                "that the job's seed does not control (seed it, or build it from torch's global RNG)"
            )
    data = build_data(task.train_data, "train_data")
    evaluation = build_data(task.eval_data, "eval_data") if task.eval_data is not None else data
    batch = _user_call("collate", task.collate_fn(), [data[i] for i in range(min(2, len(data)))])
    first.train()
    before = {name: b.detach().clone() for name, b in first.named_buffers()}
    loss = _user_call("the loss", task.loss_fn(), first, batch)
    buffers = running_buffers(first, before)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TaskError(f"the loss must be a scalar float tensor (the batch mean), got {shape}")
    if loss.grad_fn is None:
        raise TaskError(
            "the loss has no gradient (no grad_fn): compute it from the model's output with torch "
            "operations, not through .item(), .detach(), numpy or torch.no_grad()"
        )
    torch.autograd.backward(loss)  # Tensor.backward is untyped in torch; this is the function it calls
    if task.optimizer is not None:
        try:
            optimizer_from_fields(task.optimizer.to_wire())  # what the shards will check, checked here first
        except ValueError as exc:
            raise TaskError(str(exc)) from None
    eval_batch = _user_call("collate", task.collate_fn(), [evaluation[i] for i in range(min(2, len(evaluation)))])
    names = check_metrics(task, first, eval_batch)
    return CheckedTask(ModelSignature(sig.params, len(data), buffers), data, ("loss", *names))


def _user_call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` of the task's own code; TaskError naming `what` if it raises."""
    try:
        return fn(*args)
    except Exception as exc:
        raise TaskError(f"{what} failed on a batch of two samples: {type(exc).__name__}: {exc}") from None


def check_metrics(task: Task, model: nn.Module, batch: Any) -> list[str]:
    """The names the task's metrics report on `batch`; TaskError for a metric that fails or does not return
    {name: (sum, count)} with numbers, as the evaluator adds them up (dynabatch.metrics, api/metrics.py)."""
    names: list[str] = []
    model.eval()
    try:
        with torch.no_grad():
            for metric in task.metric_fns():
                label = f"metric {getattr(metric, '__name__', type(metric).__name__)}"
                result = _user_call(label, metric, model, batch)
                if not isinstance(result, dict) or not all(
                    isinstance(k, str) and _is_sum_and_count(v) for k, v in result.items()
                ):
                    raise TaskError(
                        f"{label} returned {_describe(result)}; a metric returns "
                        "{name: (sum, count)}, e.g. {'accuracy': (correct, samples)}"
                    )
                names += result
    finally:
        model.train()
    return names


def _is_sum_and_count(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in value)
    )


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(value.items())[:3]) + "}"
    return f"a {type(value).__name__}"


def build_data(factory: Callable[[], Any], what: str) -> Any:
    """Call a data factory; TaskError if it fails or yields an empty or unsized dataset."""
    try:
        data = factory()
    except Exception as exc:
        raise TaskError(f"{what}() failed: {type(exc).__name__}: {exc}") from exc
    try:
        size = len(data)
    except TypeError:
        raise TaskError(
            f"{what}() gave a {type(data).__name__} without __len__: a map-style Dataset is needed"
        ) from None
    if size == 0:
        raise TaskError(f"{what}() gave an empty dataset")
    return data
