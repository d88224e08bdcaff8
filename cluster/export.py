"""A finished run's trained model, assembled from its shard checkpoints: `dynabatch export` and `db.run`'s model.

The trainable parameters live only on the shards, each holding its chunks of the
flat float32 vector (`RUN_DIR/checkpoints/shard-*.pt`). Frozen parameters and
buffers never travel: they are what the task's model factory builds under the
job's seed, unless a checkpoint carries buffers of its own (`state["buffers"]`,
{name: tensor}), which then win. The result is the task's model with those
values in it, so its `state_dict()` is exactly what `model.load_state_dict` takes.

Pure functions over files: no sockets, no running job needed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynabatch.common.config import JobConfig, job_from_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.tasks.builtin_tasks import builtin_task
from dynabatch.common.tasks.task_check import load_task
from dynabatch.common.verified_files import read_verified
from dynabatch.common.wire.chunking import make_layout, named_travelling
from dynabatch.common.wire.model_signature import ModelSignature, signature, signature_from_fields
from dynabatch.task import Task
from dynabatch.task_error import TaskError


class ExportError(ValueError):
    """A run folder whose model cannot be assembled, with what is wrong."""


@dataclass(frozen=True)
class RunRecord:
    """What a run folder says about its job: the settings it ran with and the task it trained."""

    dir: Path
    job: JobConfig
    task_spec: str  # "" for the built-in --model on --dataset
    data_dir: str


@dataclass(frozen=True)
class TrainedState:
    """The model's state as the shards left it: the signature, the named trainable tensors, the buffers."""

    signature: ModelSignature
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def read_run(run_dir: Path) -> RunRecord:
    """The run recorded in `run_dir/config.json`; ExportError if the folder holds no run. A job run under
    `--protocol auto` is recorded as such (it may have switched protocols while it ran); its model does not depend
    on the protocol, so it is read as recorded."""
    config = run_dir / "config.json"
    if not config.is_file():
        raise ExportError(f"{run_dir} holds no run (no config.json; a run folder is what `dynabatch run` writes)")
    try:
        saved = json.loads(config.read_text())
        job = job_from_dict(saved["job"], allow_auto=True)  # a run of --protocol auto records it as given
        run = saved.get("run", {})
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise ExportError(f"{config} is not a run's settings: {exc}") from None
    return RunRecord(run_dir, job, str(run.get("task", "")), str(run.get("data_dir", "")))


def task_of(record: RunRecord, spec: str = "") -> Task:
    """The task `spec` names, or the run's own (its --task, or the built-in model on its dataset)."""
    spec = spec or record.task_spec
    if spec:
        return load_task(spec)
    job = record.job
    return builtin_task(job.dataset, job.model, record.data_dir or None)


def read_checkpoints(record: RunRecord) -> list[dict[str, Any]]:
    """Every shard's checkpoint state, in shard order; ExportError for a missing, foreign or disagreeing one."""
    folder, job = record.dir / "checkpoints", record.job
    paths = [folder / f"shard-{i}.pt" for i in range(job.shards)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ExportError(
            f"{folder}: no checkpoint of {', '.join(missing)} (the job ran {job.shards} shard(s); "
            "each writes its checkpoint once the first worker has initialised it)"
        )
    states, first_sig = [], None
    for i, path in enumerate(paths):
        try:
            saved = torch.load(io.BytesIO(read_verified(path)), map_location="cpu", weights_only=True)
            meta, state = saved["meta"], saved["state"]
            sig = state["signature"]
        except Exception as exc:
            raise ExportError(f"{path} is not a shard checkpoint ({type(exc).__name__}: {exc})") from None
        expected = {"job": job.job, "shard": i, "shards": job.shards, "chunk_bytes": job.chunk_bytes}
        if meta != expected:
            raise ExportError(f"{path} was written for {meta}, not this run's shard {expected}")
        if first_sig is not None and sig != first_sig:
            raise ExportError(f"{path} holds another model than {paths[0].name}: their signatures differ")
        first_sig = sig
        states.append(state)
    return states


def assemble(states: list[dict[str, Any]], chunk_bytes: int) -> TrainedState:
    """The named trainable tensors and the buffers from every shard's checkpoint state.

    The layout is derived, as every process of the job derives it, from the
    signature's length, `chunk_bytes` and the number of shards.
    """
    try:
        sig = signature_from_fields(**states[0]["signature"])
    except (TypeError, ValueError) as exc:
        raise ExportError(f"the checkpoints' signature is malformed: {exc}") from None
    layout = make_layout(sig.total, chunk_bytes, len(states))
    flat = torch.empty(sig.total, dtype=torch.float32)
    for chunk in layout.chunks:
        tensor = states[chunk.owner].get("params", {}).get(chunk.id)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != chunk.length:
            raise ExportError(f"shard {chunk.owner}'s checkpoint lacks chunk {chunk.id} of {chunk.length} values")
        flat[chunk.start : chunk.stop] = tensor.reshape(-1)
    params, offset = {}, 0
    for p in sig.params:
        n = int(torch.Size(p.shape).numel())
        params[p.name] = flat[offset : offset + n].view(p.shape)
        offset += n
    buffers: dict[str, torch.Tensor] = {}
    for state in states:
        buffers.update(state.get("buffers") or {})
    return TrainedState(sig, params, buffers)


def load_trained(task: Task, seed: int, trained: TrainedState) -> torch.nn.Module:
    """The task's model built under `seed` with the trained values in it.

    TaskError if the task's trainable parameters are not the checkpoints' (naming
    the first difference) or a checkpoint's buffer has no place in the model.
    """
    model = task.build_model(seed)
    # The parameters are compared here; the buffers below, by name and shape, as they are copied in.
    ours = signature(model, trained.signature.train_size, trained.signature.buffers)
    difference = ours.difference(trained.signature)
    if difference is not None:
        raise TaskError(f"the task's model is not the one the run trained: {difference}")
    own_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, p in named_travelling(model):
            p.copy_(trained.params[name])
        for name, value in trained.buffers.items():
            if name not in own_buffers or own_buffers[name].shape != value.shape:
                raise TaskError(
                    f"the checkpoints hold buffer {name} {list(value.shape)}, which the task's model "
                    "does not have at that shape"
                )
            own_buffers[name].copy_(value)
    return model


def trained_model(run_dir: Path | str, task_spec: str = "", task: Task | None = None) -> torch.nn.Module:
    """The model a run trained: its task's model (or `task`, or the one `task_spec` names) with its final values.

    `dynabatch.export`; ExportError for a folder whose model cannot be assembled, TaskError for a task that
    does not match it."""
    if not isinstance(run_dir, (str, Path)):
        raise ExportError(f"export: run_dir={run_dir!r} is not a run folder's path")
    if task is not None and not isinstance(task, Task):
        hint = " (a 'file.py:attr' spec is task_spec=)" if isinstance(task, str) else ""
        raise ExportError(f"export: task={task!r} is not a dynabatch.Task{hint}")
    record = read_run(Path(run_dir))
    trained = assemble(read_checkpoints(record), record.job.chunk_bytes)
    return load_trained(task if task is not None else task_of(record, task_spec), record.job.seed, trained)
