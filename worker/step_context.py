"""What a protocol's worker loop may use, typed: the seam between the worker and its protocol.

The worker (trainer.py) owns the training: the data order, the slowdown
emulation, the step's metrics and reports; its process (role_process.py) owns
registration and heartbeats, and what joining brought (joined.py) the job,
model and shards. A loop (gradient_steps.py,
local_steps.py) runs one protocol's step as its planner (step_plans.py) orders
it: what to pull, compute and push, and when. It sees the worker only through a `StepContext`, so a reader and a type
checker can tell exactly what a step needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.chunking import Layout, TravellingBuffers
from dynabatch.common.wire.messages import WorkerAssignment
from dynabatch.schedule import Schedule
from dynabatch.worker.ps_client import ModelVersions, ShardClients
from dynabatch.worker.step_plans import StepPlan
from dynabatch.worker.step_result import StepResult


@dataclass(frozen=True)
class Held(ModelVersions):
    """The versions of the model a worker's parameters hold: the pull its last step loaded. A loop entered on a
    protocol switch may start from it instead of pulling (StepPlan.start_held)."""


@dataclass
class StepContext:
    """The model, its data, the shards and the clock, as a step sees them.

    - `next_batch(b)`: the next b samples of this worker's order, collated, on its
      device (after a failed step, the same samples again).
    - `timed_compute(batch)`: forward and backward as this node's emulated hardware
      would run them: (loss, seconds); gradients are left on the parameters.
    - `loss_fn(model, batch)`: the task's loss (the pipelined step calls it itself).
    - `idle_for_slowdown(cpu_s)`: the emulated slowdown for `cpu_s` of work done
      elsewhere (the pipelined step); returns the seconds idled.
    - `heartbeat_when_due()`: inside a long round, hear early that the scheduler dropped this worker
      (raises RemoteError); the worker's pulse keeps it alive whatever the loop does.
    - `skip_step(loss)`: a step's loss was not finite, so its gradient was not pushed (or a local step
      not taken): counted and reported to the scheduler, which tells a diverged model from it.
    - `schedule`: the task's learning-rate schedule, which a delta protocol's inner steps follow at the job's
      progress (`WorkerAssignment.progress`); a gradient protocol's shards apply it, not the worker.
    - `buffers`: the model's travelling buffers (BatchNorm's running statistics): a step
      loads the pulled ones (`buffers.load(model, pulled.buffers)`) before computing and
      sends its own (`buffers.read(model)`) with its push; empty for most models.
    """

    job: JobConfig
    model: torch.nn.Module
    layout: Layout
    shards: ShardClients
    request_timeout_s: float
    next_batch: Callable[[int], Any]
    timed_compute: Callable[[Any], tuple[float, float]]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    idle_for_slowdown: Callable[[float], float]
    heartbeat_when_due: Callable[[], None]
    skip_step: Callable[[float], None]
    schedule: Schedule = field(default_factory=Schedule)
    buffers: TravellingBuffers = TravellingBuffers()
    pipelined: bool = False  # gradient steps overlap pull, compute and push (JobConfig.pipelines)


class StepLoop:
    """One protocol's worker loop: it executes its planner's actions (step_plans.py) against the shards; `NAME` is
    what a ProtocolSpec's `worker_loop` names, the planner's key too.

    `comm_s` is the communication time the scheduler's local-step rule weighs (msd).
    """

    NAME: ClassVar[str]
    plan: StepPlan
    comm_s: float = 0.0

    def step(self, assignment: WorkerAssignment) -> StepResult | None:
        """One step (or round of local steps) under `assignment`; None if nothing was trained."""
        raise NotImplementedError

    def after_failure(self, code: str) -> None:
        """A step failed with `code` (a shard's ERROR, or `timeout`): get ready to try again."""
        raise NotImplementedError

    def close(self) -> None:
        """The worker leaves this loop for another protocol's (`--protocol auto`): release what it holds on the model
        (the pipelined step's hooks); most loops hold nothing."""

    def held(self) -> Held | None:
        """The versions of the model the worker's parameters hold once this loop's last step loaded a whole pull
        (None: no whole one, or the model was thrown away): what the loop the worker switches to may start from."""
        return None

    def start_from(self, held: Held) -> bool:
        """The worker enters this loop on a protocol switch holding the model `held` names: start from it where
        the plan allows (StepPlan.start_held), and say whether it does; most loops pull anyway."""
        return False
