"""Rounds of the delta protocols: local SGD (`local`) and multi-step delay (`msd`).

Both run their planner's step (step_plans.py: `LocalPlan`, `MsdPlan`): H local
SGD steps, then push the delta of their parameters (global minus local: a
pseudo-gradient the shard averages by samples).

`local` then waits for the averaged model and starts the next round from it.

`msd` never waits: after pushing it keeps stepping, and when the new global
model arrives it corrects itself to global + (its progress since the push),
so communication overlaps computation completely. Its travelling buffers
(BatchNorm's running statistics) are not corrected: they are an estimate over
its own recent steps, which taking the shard's average as of the pushes would
throw away, so it keeps them and the shard averages what the workers push. It
pushes again once it has taken H steps since the last push and its previous
delta has come back averaged (at most one delta in flight). H comes from the
scheduler's assignment (AdaComm: shrinking as the loss falls, never below what
hides the communication).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from dynabatch.common.base_lr import base_lr
from dynabatch.common.config import JobConfig
from dynabatch.common.wire.chunking import flat_params, load_flat, travelling
from dynabatch.common.wire.messages import WorkerAssignment
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.schedule import Schedule
from dynabatch.worker.ps_client import PendingPull, PendingPush
from dynabatch.worker.step_context import Held, StepContext, StepLoop
from dynabatch.worker.step_plans import (
    Action,
    Advance,
    Compute,
    LocalPlan,
    MsdPlan,
    Pull,
    Pulled,
    Push,
    finish,
    round_after,
    send,
)
from dynabatch.worker.step_result import StepResult


def inner_optimizer(
    optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, job: JobConfig, lr_scale: float
) -> torch.optim.Optimizer:
    """A worker's inner SGD (`optimizer`, built on `model`'s travelling parameters from the job's flags where None)
    at its step now: the job's base lr (common/base_lr.py: under auto the delay step's default) times the
    scheduler's `lr_scale`. The simulator's workers step with it too."""
    if optimizer is None:
        optimizer = torch.optim.SGD(
            travelling(model), lr=base_lr(job), momentum=job.momentum, weight_decay=job.weight_decay
        )
    for group in optimizer.param_groups:
        group["lr"] = base_lr(job) * lr_scale
    return optimizer


def inner_scale(assignment: WorkerAssignment, schedule: Schedule) -> float:
    """The factor on a delta protocol's inner steps: the scheduler's `lr_scale` times the task's `schedule` at the
    job's progress. The shards' outer optimizer steps at --outer-lr, so the schedule is the workers' to follow (a
    gradient protocol's shards apply it instead)."""
    return assignment.lr_scale * schedule.factor(assignment.progress)


@dataclass
class _LocalSteps(StepLoop):
    """What both delta protocols keep: the inner optimizer and the global model a worker started from."""

    ctx: StepContext
    optimizer: torch.optim.Optimizer | None = None
    base: torch.Tensor | None = None
    base_versions: dict[int, int] = field(default_factory=dict)
    version: int = 0
    start: Held | None = None  # the model the worker held when it switched to this loop, until its first sync

    def start_from(self, held: Held) -> bool:
        if not self.plan.start_held():
            return False
        self.start = held
        return True

    def _optimizer(self, assignment: WorkerAssignment) -> torch.optim.Optimizer:
        scale = inner_scale(assignment, self.ctx.schedule)
        self.optimizer = inner_optimizer(self.optimizer, self.ctx.model, self.ctx.job, scale)
        return self.optimizer

    def _local_step(self, assignment: WorkerAssignment) -> tuple[float, float]:
        """One SGD step on this worker's own copy of the model: (loss, emulated seconds)."""
        c = self.ctx
        loss, seconds = c.timed_compute(c.next_batch(assignment.batch))
        if math.isfinite(loss):
            self._optimizer(assignment).step()
        else:
            c.skip_step(loss)
        c.heartbeat_when_due()
        return loss, seconds

    def _sync(self, pull: Action | None) -> tuple[Pulled, float]:
        """Run the plan's `pull` of the global model (waiting for the round when one is open) and start from it:
        (what it brought, the seconds it took)."""
        assert isinstance(pull, Pull)
        c = self.ctx
        if pull.held:
            assert self.start is not None, "a plan starts held only once start_from named the model"
            held, self.start = self.start, None
            self.base = flat_params(c.model)
            self.base_versions, self.version = dict(held.chunk_versions), held.version
            return Pulled(list(held.shard_versions), self.version), 0.0
        start = time.perf_counter()
        pulled = c.shards.pull(pull.min_versions, c.request_timeout_s)
        load_flat(c.model, pulled.flat)
        c.buffers.load(c.model, pulled.buffers)
        self.base = pulled.flat.clone()
        self.base_versions, self.version = pulled.chunk_versions, pulled.version
        return Pulled(pulled.shard_versions, pulled.version), time.perf_counter() - start

    def after_failure(self, code: str) -> None:
        """Start over from the current global model; a delta lost in flight is simply not counted."""
        self.plan.after_failure(code)
        self.base = self.start = None


@dataclass
class LocalRoundLoop(_LocalSteps):
    """`local`: sync, H local steps, push the delta, and (next round) wait for the average: `LocalPlan`'s step."""

    NAME = "local"
    plan: LocalPlan = field(default_factory=LocalPlan)

    def step(self, assignment: WorkerAssignment) -> StepResult | None:
        c = self.ctx
        times = StepTimes()
        plan = self.plan.step(assignment)
        pulled, times.wait_s = self._sync(next(plan))
        compute = send(plan, pulled)
        assert isinstance(compute, Compute) and self.base is not None
        losses = []
        for _ in range(compute.steps):
            loss, seconds = self._local_step(assignment)
            times.compute_s += seconds
            losses.append(loss)
        push = send(plan, True)
        assert isinstance(push, Push)
        start = time.perf_counter()
        delta = self.base - flat_params(c.model)
        acks = c.shards.push(
            delta,
            self.base_versions,
            push.samples,
            _mean(losses),
            c.request_timeout_s,
            kind=push.kind,
            buffers=c.buffers.read(c.model),
        )
        times.push_s = time.perf_counter() - start
        finish(plan, acks)
        return StepResult(times, compute.batch, _mean(losses), self.version, compute.steps)


@dataclass
class MsdLoop(_LocalSteps):
    """`msd`: one local step at a time, looking after the delta in flight without ever blocking on it: `MsdPlan`'s
    step."""

    NAME = "msd"
    plan: MsdPlan = field(default_factory=MsdPlan)
    # The delta in flight: its push, the pull of the average once the push is acknowledged, and the anchor (this
    # worker's model when it pushed, which its progress since is measured from).
    in_flight: tuple[PendingPush, PendingPull | None, torch.Tensor] | None = None
    sent_at: float = 0.0
    push_s: float = 0.0

    def step(self, assignment: WorkerAssignment) -> StepResult | None:
        times = StepTimes()
        plan = self.plan.step(assignment)
        action: Action | None = next(plan)
        if isinstance(action, Pull):
            pulled, times.pull_s = self._sync(action)
            action = send(plan, pulled)
        assert isinstance(action, Compute)
        loss, times.compute_s = self._local_step(assignment)
        action = send(plan, True)
        if isinstance(action, Advance):
            assert self.in_flight is not None
            action = send(plan, self._advance(self.in_flight))
        if isinstance(action, Push):
            start = time.perf_counter()
            self._push_delta(action, loss)
            times.push_s = time.perf_counter() - start
            action = send(plan, None)
        assert action is None
        return StepResult(times, assignment.batch, loss, self.version)

    def _push_delta(self, push: Push, loss: float) -> None:
        c = self.ctx
        base = self.base
        assert base is not None  # step() syncs before its first local step
        anchor = flat_params(c.model)
        pending = c.shards.start_push(
            base - anchor, self.base_versions, push.samples, loss, kind=push.kind, buffers=c.buffers.read(c.model)
        )
        self.in_flight = (pending, None, anchor)
        self.sent_at = time.perf_counter()

    def _advance(self, in_flight: tuple[PendingPush, PendingPull | None, torch.Tensor]) -> bool:
        """Take what has arrived for the delta `in_flight`; once the averaged model is in, correct onto it.
        Returns whether it did."""
        c = self.ctx
        push, pull, anchor = in_flight
        if time.perf_counter() - self.sent_at > c.request_timeout_s:
            raise TimeoutError(f"the averaged model did not come back within {c.request_timeout_s:.0f}s")
        c.shards.advance([push] + ([pull] if pull else []))
        if pull is None and push.done():
            self.push_s = time.perf_counter() - self.sent_at
            pull = c.shards.start_pull(round_after(push.acks[s] for s in sorted(push.acks)))
            self.in_flight = (push, pull, anchor)
        if pull is None or not pull.done():
            return False
        result = pull.result()
        progress = flat_params(c.model) - anchor
        load_flat(c.model, result.flat + progress)
        self.base = result.flat.clone()
        self.base_versions, self.version = result.chunk_versions, result.version
        arrivals = pull.arrived_at.values()
        # Transfer time only: the time the pull sat parked waiting for other workers'
        # deltas is the round, not communication, and must not raise H.
        self.comm_s = self.push_s + max(arrivals) - min(arrivals)
        self.in_flight = None
        return True

    def after_failure(self, code: str) -> None:
        super().after_failure(code)
        self.in_flight = None


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan
