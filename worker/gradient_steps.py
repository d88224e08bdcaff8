"""Worker loops of the gradient protocols: pull, forward/backward, push.

`GradientLoop` runs every gradient protocol's step as its `GradientPlan`
(step_plans.py) orders it: asgd, softsync, ssp, ringmaster (a shard may hold an
ssp pull back, which the worker sees as waiting), rennala (a pull the shard holds
until the next round counts as waiting) and ssgd (the pull asks each shard for
the version the previous round produces, so the worker waits for the round to
close before computing on the new model). Every loop stops when the scheduler
says so: its allotment of the job's samples trained (common/allotment.py), a
worker idles.

With the job's `push_pull` (the default) a step's push also brings back the
model the next step computes on (`ShardClients.push_pull`): the same model a
pull right after the push would get, in one round trip instead of two. Its
time until every shard acknowledged counts as push, the rest as pull (or, when
the pull waits for a round, as wait).

With `prefetch_pull` (asgd, softsync) the next step's pull leaves as soon as
this step's model is loaded, and its chunks arrive while the worker computes;
the push's wait takes them in. The next step then computes on a model that
lacks this step's own gradient: the staleness it adds is what the shard's
staleness histogram shows. With `push_behind` as well, the push is not
awaited either: its acknowledgement is taken after the next compute, before the
next push, so at most one push is unacknowledged.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.chunking import flat_grads, load_flat
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import WorkerAssignment
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.worker.pipeline import Pipeline
from dynabatch.worker.ps_client import PendingPull, PendingPush, PullResult
from dynabatch.worker.step_context import Held, StepContext, StepLoop
from dynabatch.worker.step_plans import Compute, GradientPlan, Pull, Pulled, Push, finish, send
from dynabatch.worker.step_result import StepResult


@dataclass
class GradientLoop(StepLoop):
    """Gradient steps as the protocol's `GradientPlan` orders them (the planner holds what the next pull waits
    for, `min_versions`)."""

    NAME = "gradient"
    ctx: StepContext
    plan: GradientPlan = field(init=False)
    pipeline: Pipeline | None = None
    pulled: PullResult | None = None  # the model the last push brought back, for the next step
    ahead: PendingPull | None = None  # the next step's pull, sent before this step's compute (prefetch_pull)
    unacked: PendingPush | None = None  # the last step's push, acknowledged during this step (push_behind)
    loaded: Held | None = None  # the versions of the model the last step loaded (not pipelined)

    def __post_init__(self) -> None:
        job = self.ctx.job
        self.plan = GradientPlan(protocol_spec(job.protocol))

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    @property
    def min_versions(self) -> list[int] | None:
        """What the next pull waits for (None: whatever the shards hold)."""
        return self.plan.min_versions

    def step(self, assignment: WorkerAssignment) -> StepResult | None:
        c = self.ctx
        if c.pipelined:
            return self._pipelined_step(assignment)
        times = StepTimes()
        plan = self.plan.step(assignment)
        pull = next(plan)
        assert isinstance(pull, Pull)
        pulled, self.pulled = self.pulled, None
        if pulled is None:
            start = time.perf_counter()
            if self.ahead is not None:
                pulled = self._take_ahead(c, self.ahead)
            else:
                pulled = c.shards.pull(pull.min_versions, c.request_timeout_s)
            _add_pull_time(times, pull.waits, time.perf_counter() - start)
        compute = send(plan, Pulled(pulled.shard_versions, pulled.version))
        if compute is None:
            return None
        assert isinstance(compute, Compute)
        load_flat(c.model, pulled.flat)
        c.buffers.load(c.model, pulled.buffers)
        self.loaded = Held(dict(pulled.chunk_versions), list(pulled.shard_versions))
        if c.job.prefetch_pull:
            self.ahead = c.shards.start_pull()
        loss, times.compute_s = c.timed_compute(c.next_batch(compute.batch))
        if not math.isfinite(loss):
            c.skip_step(loss)
            send(plan, False)
            return None
        start = time.perf_counter()
        grads, versions, buffers = flat_grads(c.model), pulled.chunk_versions, c.buffers.read(c.model)
        push = send(plan, True)
        assert isinstance(push, Push)
        acks = None
        if c.job.push_pull and not c.job.prefetch_pull:
            self.pulled, times.push_s = c.shards.push_pull(
                grads, versions, push.samples, loss, c.request_timeout_s, push.then_pull, buffers
            )
            _add_pull_time(times, self.plan.pull_waits(), time.perf_counter() - start - times.push_s)
        elif c.job.push_behind:
            if self.unacked is not None:
                c.shards.finish_push(self.unacked, c.request_timeout_s, beside=self.ahead)
            self.unacked = c.shards.start_push(grads, versions, push.samples, loss, buffers=buffers)
            times.push_s = time.perf_counter() - start
        else:
            acks = c.shards.push(
                grads, versions, push.samples, loss, c.request_timeout_s, buffers=buffers, beside=self.ahead
            )
            times.push_s = time.perf_counter() - start
        finish(plan, acks)
        return StepResult(times, compute.batch, loss, pulled.version)

    def _take_ahead(self, c: StepContext, ahead: PendingPull) -> PullResult:
        """The prefetched pull, once every chunk of it has arrived (most did during the last compute)."""
        self.ahead = None
        c.shards.wait([ahead] if self.unacked is None else [ahead, self.unacked], c.request_timeout_s, until=ahead.done)
        return ahead.result()

    def _pipelined_step(self, assignment: WorkerAssignment) -> StepResult | None:
        """The plan's pull, compute and push overlapped chunk by chunk (pipeline.py): one operation, which asks
        the planner what its parts would (what the pull waits for)."""
        c, plan = self.ctx, self.plan
        if self.pipeline is None:
            self.pipeline = Pipeline(
                c.model, c.layout, c.shards, c.job.max_inflight_bytes, c.request_timeout_s, c.loss_fn, c.buffers
            )
        batch = c.next_batch(assignment.batch)
        wall, cpu = time.perf_counter(), time.thread_time()
        # The scheduled wire sends a round's next pull as soon as its pushes are out (pipeline.py).
        ahead = plan.round_after if c.job.chunk_schedule == "scheduled" else None
        result = self.pipeline.step(
            batch, plan.min_versions, assignment.batch, assignment.chunk_group, assignment.credit_bytes, ahead
        )
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        times = StepTimes(push_s=result.push_wait_s)
        _add_pull_time(times, plan.pull_waits(), result.pull_wait_s)
        times.compute_s = wall - result.pull_wait_s - result.push_wait_s + c.idle_for_slowdown(cpu)
        plan.last_versions = result.pulled.shard_versions
        if not math.isfinite(result.loss):  # the pipeline pushed nothing
            c.skip_step(result.loss)
            return None
        plan.pulled(result.pulled.shard_versions)
        return StepResult(times, assignment.batch, result.loss, result.pulled.version)

    def after_failure(self, code: str) -> None:
        """The planner decides what the next pull waits for; the model brought or sent ahead is dropped, and after a
        rollback the one the parameters hold too (it was thrown away)."""
        self.plan.after_failure(code)
        self.pulled = self.ahead = self.unacked = None
        if self.pipeline is not None:
            self.pipeline.ahead = None
        if code == ErrorCode.ROLLED_BACK:
            self.loaded = None
            if self.pipeline is not None:
                self.pipeline.loaded = None

    def held(self) -> Held | None:
        if self.pipeline is None:
            return self.loaded
        pull = self.pipeline.loaded
        if pull is None or not pull.done():
            return None
        return Held(dict(pull.versions), pull.result().shard_versions)


def _add_pull_time(times: StepTimes, waits: bool, seconds: float) -> None:
    """A pull's seconds are waiting when it waits for other workers (a round), pulling otherwise."""
    if waits:
        times.wait_s += seconds
    else:
        times.pull_s += seconds
