"""What is trained: one `Task` (model factory, data, collate, loss, metrics, optimizer, schedule).

Only workers and evaluators run a task's code. Shards are a generic parameter
store that the first worker initialises with the model's signature and initial
parameters; the scheduler learns the training set's length from the workers.
The built-in models and datasets are tasks like any other (common/builtin_tasks.py).

A task is loaded by `--task path/to/file.py:attr` or `--task pkg.module:attr`;
everything that can be wrong with it (it does not import, it is not a Task, its
model is not reproducible, its data is empty, its loss is not a scalar, its
parameters are of a dtype that cannot travel) is a `TaskError` with one clear
message, found before any process starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils.data import default_collate

from dynabatch.common.chunking import named_travelling
from dynabatch.common.eval_metrics import Metric, accuracy
from dynabatch.common.optim_spec import OptimizerSpec, optimizer_from_fields
from dynabatch.common.schedules import Schedule
from dynabatch.common.task_error import TaskError
from dynabatch.common.task_spec import names_a_file, split_task_spec

TRAVELLING_DTYPES = (torch.float32,)
TRAVELLING_DTYPE_NAMES = ("float32",)
BUFFER_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")  # they travel as float32 whatever they are


@dataclass
class Task:
    """Everything dynabatch needs to train a model: the pinned user-facing API (`dynabatch.Task`).

    - `model`: () -> nn.Module, built under the job's seed in every process; two builds must be identical.
    - `train_data`, `eval_data`: () -> a map-style torch Dataset (`__len__`, `__getitem__`).
    - `collate`: list of samples -> batch (default: torch's `default_collate`); batches may be tuples or dicts.
    - `loss`: (model, batch) -> mean loss tensor (default: cross-entropy on an (x, y) batch).
    - `metrics`: (model, batch) -> {name: (sum, count)}, or a list of such (default: accuracy);
      the evaluation loss is always reported too.
    - `optimizer`: the shards' optimizer (dynabatch.optim); None: SGD from the job's flags.
    - `schedule`: the learning rate against global progress (dynabatch.schedule); None: constant.
    - `clip_grad_norm`: clip each worker's gradient to this norm before it is pushed.
    """

    model: Callable[[], nn.Module]
    train_data: Callable[[], Any]
    eval_data: Callable[[], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    metrics: Metric | Sequence[Metric] | None = None
    optimizer: OptimizerSpec | None = None
    schedule: Schedule | None = None
    clip_grad_norm: float | None = None
    name: str = field(default="task", compare=False)

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self.collate or default_collate

    def loss_fn(self) -> Callable[[nn.Module, Any], torch.Tensor]:
        return self.loss or cross_entropy

    def metric_fns(self) -> list[Metric]:
        if self.metrics is None:
            return [accuracy]
        return list(self.metrics) if isinstance(self.metrics, (list, tuple)) else [self.metrics]

    def build_model(self, seed: int) -> nn.Module:
        """The model at its initial parameters under `seed`, leaving the caller's RNG as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.model()


def cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: cross-entropy of model(x) against labels y."""
    x, y = batch[0], batch[1]
    return nn.functional.cross_entropy(model(x), y)


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as it travels: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelSignature:
    """What every process of a job must agree on: the trainable parameters, in order, the
    travelling buffers, in order, and the data's length.

    `buffers` are the floating-point buffers a training forward changes (BatchNorm's
    running mean and variance): they travel beside the parameters, as one flat float32
    vector held by shard 0, so that evaluation and export see the job's estimate rather
    than a worker's own or the factory's. Buffers a forward leaves alone, and integer
    counters such as `num_batches_tracked`, are rebuilt by the model factory and never sent.
    """

    params: tuple[ParamSpec, ...]
    train_size: int
    buffers: tuple[ParamSpec, ...] = ()

    @property
    def total(self) -> int:
        """Number of trainable values: the flat vector's length."""
        return _count(self.params)

    @property
    def buffer_total(self) -> int:
        """Number of travelling buffer values: the flat buffer vector's length (0: nothing travels)."""
        return _count(self.buffers)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)

    def difference(self, other: "ModelSignature") -> str | None:
        """A sentence naming the first difference from `other`, or None if they match."""
        found = (_first_difference("parameter", "trainable parameters", self.params, other.params)
                 or _first_difference("buffer", "travelling buffers", self.buffers, other.buffers))
        if found is None and self.train_size != other.train_size:
            found = f"the training set holds {self.train_size} samples here, {other.train_size} in the job"
        return found


def _count(specs: tuple[ParamSpec, ...]) -> int:
    return sum(math.prod(s.shape) for s in specs)


def _first_difference(what: str, plural: str, mine: tuple[ParamSpec, ...], theirs: tuple[ParamSpec, ...]) -> str | None:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"{what} {i} is {a.name} {list(a.shape)} {a.dtype} here but "
                    f"{b.name} {list(b.shape)} {b.dtype} in the job")
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))]
        return f"{len(mine)} {plural} here, {len(theirs)} in the job (first unmatched: {extra.name})"
    return None


def signature(model: nn.Module, train_size: int, buffers: tuple[ParamSpec, ...] = ()) -> ModelSignature:
    """The model's signature; TaskError for a parameter of a dtype that cannot travel."""
    params = []
    for name, p in named_travelling(model):
        if p.dtype not in TRAVELLING_DTYPES:
            raise TaskError(f"parameter {name} is {p.dtype}; trainable parameters must be float32 "
                            "(keep a lower precision for compute with autocast, not in the parameters)")
        params.append(ParamSpec(name, tuple(p.shape), _dtype_name(p.dtype)))
    if not params:
        raise TaskError("the model has no trainable parameters")
    return ModelSignature(tuple(params), train_size, buffers)


def running_buffers(model: nn.Module, before: dict[str, torch.Tensor]) -> tuple[ParamSpec, ...]:
    """The floating-point buffers that differ from `before` (taken before a training forward), in order.

    These are the buffers that travel. Integer buffers that a forward changes
    (`num_batches_tracked`) are counters, not estimates: each process keeps its own.
    """
    return tuple(ParamSpec(name, tuple(b.shape), _dtype_name(b.dtype)) for name, b in model.named_buffers()
                 if b.is_floating_point() and (name not in before or not torch.equal(before[name], b)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    for (name, a), (_, b) in zip(named_travelling(first), named_travelling(second)):
        if not torch.equal(a, b):
            raise TaskError(f"two builds of the model differ in {name}: its construction uses randomness "
                            "that the job's seed does not control (seed it, or build it from torch's global RNG)")
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
        raise TaskError("the loss has no gradient (no grad_fn): compute it from the model's output with torch "
                        "operations, not through .item(), .detach(), numpy or torch.no_grad()")
    loss.backward()
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
    {name: (sum, count)} with numbers, as the evaluator adds them up (common/eval_metrics.py)."""
    names: list[str] = []
    model.eval()
    try:
        with torch.no_grad():
            for metric in task.metric_fns():
                label = f"metric {getattr(metric, '__name__', type(metric).__name__)}"
                result = _user_call(label, metric, model, batch)
                if not isinstance(result, dict) or not all(
                        isinstance(k, str) and _is_sum_and_count(v) for k, v in result.items()):
                    raise TaskError(f"{label} returned {_describe(result)}; a metric returns "
                                    "{name: (sum, count)}, e.g. {'accuracy': (correct, samples)}")
                names += result
    finally:
        model.train()
    return names


def _is_sum_and_count(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in value)


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
        raise TaskError(f"{what}() gave a {type(data).__name__} without __len__: a map-style Dataset is needed")
    if size == 0:
        raise TaskError(f"{what}() gave an empty dataset")
    return data


MAX_TRAVELLING_VALUES = 1 << 31  # 8 GiB of float32: beyond it a shard refuses to allocate a model


def signature_fields(sig: ModelSignature) -> dict[str, Any]:
    """The signature as INIT's fields."""
    return {"names": [p.name for p in sig.params], "shapes": [list(p.shape) for p in sig.params],
            "dtypes": [p.dtype for p in sig.params], "train_size": sig.train_size,
            "buffer_names": [b.name for b in sig.buffers], "buffer_shapes": [list(b.shape) for b in sig.buffers],
            "buffer_dtypes": [b.dtype for b in sig.buffers]}


def signature_from_fields(names: list[str], shapes: list[list[int]], dtypes: list[str], train_size: int,
                          buffer_names: Sequence[str] = (), buffer_shapes: Sequence[Sequence[int]] = (),
                          buffer_dtypes: Sequence[str] = ()) -> ModelSignature:
    """A signature received from a peer; ValueError naming what is malformed or out of bounds.

    The buffer fields are optional: a signature without them (an older peer or
    checkpoint) is a model whose buffers do not travel.
    """
    params = _specs("parameter", names, shapes, dtypes, TRAVELLING_DTYPE_NAMES)
    if not params:
        raise ValueError("no parameters: a model has at least one trainable parameter")
    buffers = _specs("buffer", buffer_names, buffer_shapes, buffer_dtypes, BUFFER_DTYPE_NAMES)
    sig = ModelSignature(params, train_size, buffers)
    if train_size <= 0:
        raise ValueError(f"train_size {train_size}: a job trains on a non-empty dataset")
    if sig.total > MAX_TRAVELLING_VALUES:
        raise ValueError(f"{sig.total} parameters exceed the limit of {MAX_TRAVELLING_VALUES}")
    if sig.buffer_total > MAX_TRAVELLING_VALUES:
        raise ValueError(f"{sig.buffer_total} buffer values exceed the limit of {MAX_TRAVELLING_VALUES}")
    return sig


def _specs(what: str, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
           allowed: tuple[str, ...]) -> tuple[ParamSpec, ...]:
    if not (len(names) == len(shapes) == len(dtypes)):
        raise ValueError(f"{len(names)} {what} names, {len(shapes)} shapes and {len(dtypes)} dtypes: "
                         f"one of each per {what}")
    specs = []
    for name, shape, dtype in zip(names, shapes, dtypes):
        if dtype not in allowed:
            raise ValueError(f"{what} {name}: dtype {dtype!r}; a {what} may be {', '.join(allowed)}")
        if len(shape) > 8 or any(d < 0 for d in shape):
            raise ValueError(f"{what} {name}: shape {shape} is not a tensor shape")
        specs.append(ParamSpec(name, tuple(shape), dtype))
    return tuple(specs)
