"""Worker loops of the gradient protocols: pull, forward/backward, push.

`GradientLoop` serves every protocol whose shard decides alone what a gradient
does (asgd, softsync, ssp, ringmaster: a shard may hold an ssp pull back, which the
worker sees as waiting). `SampleRoundLoop` is rennala's: the same step, with a pull
the shard holds until the next round counted as waiting. `RoundLoop` is ssgd's: the
same step, except that the pull asks each shard for the version the previous round
produces, so the worker waits for the round to close (its `wait` time) before
computing on the new model; and it stops by itself once the model has had all the job's rounds (each
round is one global batch B), so no worker starts a round the others will not
join.

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
from dataclasses import dataclass

from dynabatch.common.chunking import flat_grads, load_flat
from dynabatch.common.error_codes import ErrorCode
from dynabatch.common.messages import Assignment
from dynabatch.worker.pipeline import Pipeline
from dynabatch.worker.ps_client import PendingPull, PendingPush, PullResult
from dynabatch.worker.step_context import StepContext, StepLoop
from dynabatch.worker.step_times import StepResult, StepTimes


@dataclass
class GradientLoop(StepLoop):
    """Gradient steps; `min_versions` is what the next pull waits for (None: whatever is there)."""

    NAME = "gradient"
    ctx: StepContext
    min_versions: list[int] | None = None
    last_versions: list[int] | None = None
    pipeline: Pipeline | None = None
    pulled: PullResult | None = None  # the model the last push brought back, for the next step
    ahead: PendingPull | None = None  # the next step's pull, sent before this step's compute (prefetch_pull)
    unacked: PendingPush | None = None  # the last step's push, acknowledged during this step (push_behind)

    def _done(self, version: int) -> bool:
        """Whether the model at `version` ends this worker's training (never, unless the protocol has rounds)."""
        return False

    def _next_round(self, pulled_versions: list[int]) -> None:
        """Set what the next pull waits for, given the shard versions this step computed on."""

    def step(self, assignment: Assignment) -> StepResult | None:
        c = self.ctx
        if c.pipelined:
            return self._pipelined_step(assignment)
        times = StepTimes()
        pulled, self.pulled = self.pulled, None
        if pulled is None:
            start = time.perf_counter()
            if self.ahead is not None:
                pulled = self._take_ahead(c, self.ahead)
            else:
                pulled = c.shards.pull(self.min_versions, c.request_timeout_s)
            self._add_pull_time(times, time.perf_counter() - start)
        self.last_versions = pulled.shard_versions
        if self._done(pulled.version):
            return None
        load_flat(c.model, pulled.flat)
        c.buffers.load(c.model, pulled.buffers)
        if c.job.prefetch_pull:
            self.ahead = c.shards.start_pull()
        loss, times.compute = c.timed_compute(c.next_batch(assignment.batch))
        if not math.isfinite(loss):
            c.skip_step(loss)
            return None
        start = time.perf_counter()
        grads, versions, buffers = flat_grads(c.model), pulled.chunk_versions, c.buffers.read(c.model)
        self._next_round(pulled.shard_versions)
        if c.job.push_pull and not c.job.prefetch_pull:
            self.pulled, times.push = c.shards.push_pull(grads, versions, assignment.batch, loss, c.request_timeout_s,
                                                         self.min_versions, buffers)
            self._add_pull_time(times, time.perf_counter() - start - times.push)
        elif c.job.push_behind:
            if self.unacked is not None:
                c.shards.finish_push(self.unacked, c.request_timeout_s, beside=self.ahead)
            self.unacked = c.shards.start_push(grads, versions, assignment.batch, loss, buffers=buffers)
            times.push = time.perf_counter() - start
        else:
            c.shards.push(grads, versions, assignment.batch, loss, c.request_timeout_s, buffers=buffers,
                          beside=self.ahead)
            times.push = time.perf_counter() - start
        return StepResult(times, assignment.batch, loss, pulled.version)

    def _take_ahead(self, c: StepContext, ahead: PendingPull) -> PullResult:
        """The prefetched pull, once every chunk of it has arrived (most did during the last compute)."""
        self.ahead = None
        c.shards.wait([ahead] if self.unacked is None else [ahead, self.unacked], c.request_timeout_s,
                      until=ahead.done)
        return ahead.result()

    def _pull_waits(self) -> bool:
        """Whether a pull's time is waiting for other workers (for a round), not this worker's own pulling."""
        return self.min_versions is not None

    def _add_pull_time(self, times: StepTimes, seconds: float) -> None:
        """A pull's seconds are waiting when it waits for a round, pulling otherwise."""
        if self._pull_waits():
            times.wait += seconds
        else:
            times.pull += seconds

    def _pipelined_step(self, assignment: Assignment) -> StepResult | None:
        """The same step with pull, compute and push overlapped chunk by chunk (pipeline.py)."""
        c = self.ctx
        if self.pipeline is None:
            self.pipeline = Pipeline(c.model, c.layout, c.shards, c.job.max_inflight_bytes, c.request_timeout_s,
                                     c.loss_fn, c.buffers)
        if self.last_versions is not None and self._done(min(self.min_versions or self.last_versions)):
            # Leave only once the last round has closed: a worker that left while it was open would have the
            # scheduler hand its batch to the others, and one that had not drawn its batch for that round yet
            # would draw the larger one, making the last round more than B samples.
            c.shards.pull(self.min_versions, c.request_timeout_s)
            return None
        batch = c.next_batch(assignment.batch)
        wall, cpu = time.perf_counter(), time.thread_time()
        result = self.pipeline.step(batch, self.min_versions, assignment.batch, assignment.chunk_group,
                                    assignment.credit_bytes)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        times = StepTimes(push=result.push_wait_s)
        self._add_pull_time(times, result.pull_wait_s)
        times.compute = wall - result.pull_wait_s - result.push_wait_s + c.idle_for_slowdown(cpu)
        self.last_versions = result.pulled.shard_versions
        if not math.isfinite(result.loss):  # the pipeline pushed nothing
            c.skip_step(result.loss)
            return None
        self._next_round(result.pulled.shard_versions)
        return StepResult(times, assignment.batch, result.loss, result.pulled.version)

    def after_failure(self, code: str) -> None:
        """Start over from whatever the shards hold."""
        self.min_versions = None
        self.pulled = self.ahead = self.unacked = None


@dataclass
class RoundLoop(GradientLoop):
    """ssgd: every step is one round; the next pull waits for the round this step's gradient went into."""

    NAME = "round"

    def _done(self, version: int) -> bool:
        """Has the model had epochs * train_size / B rounds?"""
        job = self.ctx.job
        self.finished = version >= math.ceil(job.epochs * self.ctx.train_size / job.global_batch)
        return self.finished

    def _next_round(self, pulled_versions: list[int]) -> None:
        self.min_versions = [v + 1 for v in pulled_versions]

    def after_failure(self, code: str) -> None:
        """After "already pushed in this round" the next pull must wait for that round; otherwise start over."""
        self.pulled = self.ahead = None
        if code == ErrorCode.BAD_STATE and self.last_versions is not None:
            self.min_versions = [v + 1 for v in self.last_versions]
        else:
            self.min_versions = None


@dataclass
class SampleRoundLoop(GradientLoop):
    """rennala: GradientLoop's step, on whatever model the shards hold; a shard holds a pull while the round
    already has its samples on their way, and answers it with the next round's model. That time is waiting
    for other workers, not this worker's own step, so it counts as `wait` (the speed model leaves it out)."""

    NAME = "sample_round"

    def _pull_waits(self) -> bool:
        return True
