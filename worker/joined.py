"""What a worker or evaluator has once the scheduler has welcomed it into a job.

Everything here follows from the WELCOME: the job's config, the task it names
(or `--task`), the model built from it on this process's device, the model's
layout over the shards and its travelling buffers, and one client per shard.
It is made in one piece at that moment (`Joined.welcomed`), so the processes
that hold it (trainer.py, evaluator.py) never hold half of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from dynabatch.common.config import JobConfig, check_flags_against_task
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.tasks.builtin_tasks import builtin_task
from dynabatch.common.tasks.task_check import check_task, load_task
from dynabatch.common.tasks.weights import load_weights, read_state_dict
from dynabatch.common.wire.chunking import Layout, TravellingBuffers, flat_params, make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import Init, Welcome
from dynabatch.common.wire.model_signature import ModelSignature, signature_fields
from dynabatch.schedule import schedule_fields
from dynabatch.task import Task
from dynabatch.task_error import TaskError
from dynabatch.worker.options import WorkerOptions
from dynabatch.worker.ps_client import ShardClients

log = logging.getLogger("dynabatch.worker")


def task_for(opts: WorkerOptions, job: JobConfig) -> Task:
    """The task this worker trains: `--task`, or the job's built-in model on its dataset; ConfigError if the
    job's flags conflict with it (`check_flags_against_task`: a hand-started scheduler's flags meet the task here)."""
    task = load_task(opts.task) if opts.task else builtin_task(job.dataset, job.model, opts.data_dir or None)
    check_flags_against_task(job, task.optimizer)
    return task


@dataclass
class Joined:
    """This process's part in a job: its id there, the job, the task with its training set and loss, the model
    and its layout and travelling buffers, and the shards' clients.

    `id` is the scheduler's name for this process; it changes when the process
    registers again (`rename`). `number` is its first registration's (Welcome.number).
    """

    id: str
    number: int
    job: JobConfig
    task: Task
    signature: ModelSignature
    train_data: Any
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    model: torch.nn.Module
    layout: Layout
    buffers: TravellingBuffers
    shards: ShardClients

    @classmethod
    def welcomed(
        cls,
        welcome: Welcome,
        job: JobConfig,
        opts: WorkerOptions,
        ctx: zmq.Context[zmq.Socket[bytes]],
        device: torch.device,
        idle: Callable[[], None],
    ) -> Joined:
        """Load the task and build its model (`--init`'s weights, if given) for the job of `welcome`; `idle`
        runs while a shard request waits (the heartbeat)."""
        task = task_for(opts, job)
        sig, train_data, _ = check_task(task, job.seed)
        model = task.build_model(job.seed).to(device)
        if opts.init:
            load_weights(model, read_state_dict(opts.init), f"--init {opts.init}")
        layout = make_layout(sig.total, job.chunk_bytes, job.shards)
        shards = ShardClients(ctx, welcome.shards, layout, job.job, welcome.id, idle, job.heartbeat_s, sig.buffer_total)
        return cls(
            welcome.id,
            welcome.number,
            job,
            task,
            sig,
            train_data,
            task.loss_fn(),
            model,
            layout,
            TravellingBuffers(sig.buffer_names),
            shards,
        )

    def init_shards(self, timeout_s: float) -> bool:
        """Send the shards this model (INIT): the first to arrive sets it, the others are checked against it.
        True if this process initialised any shard; TaskError if they refuse the model, optimizer or schedule.

        A shard whose link dropped before it answered (it stopped or restarted) refused nothing: the offer is sent
        again, as a failed step is, and waits in ZeroMQ's queue until the shard is back."""
        task = self.task
        init = Init(
            **signature_fields(self.signature),
            optimizer=task.optimizer.to_wire() if task.optimizer else {},
            schedule=schedule_fields(task.schedule),
        )
        while True:
            try:
                acks = self.shards.init(init, flat_params(self.model), timeout_s, self.buffers.read(self.model))
                return any(a.initialized for a in acks)
            except RemoteError as exc:
                if exc.code != ErrorCode.SHARD_LOST:
                    raise TaskError(f"the job's shards refused this worker's model: {exc.text}") from None
                log.info("offering the model again: %s", exc.text)

    def rename(self, new_id: str) -> None:
        """The scheduler registered this process again under `new_id`: the shards hear from it under that."""
        self.id = new_id
        for conn in self.shards.conns:
            conn.sender = new_id
