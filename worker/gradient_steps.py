"""Steps of the gradient protocols (asgd, softsync, ssgd): pull, forward/backward, push.

ssgd is the same step with two differences: the pull asks each shard for the
version that the previous round produces, so the worker waits for the round
to close (its `wait` time) before computing on the new model; and a worker
stops by itself once the model has had all the job's rounds (each round is
one global batch B), so no worker starts a round the others will not join.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from dynabatch.common.chunking import flat_grads, load_flat
from dynabatch.common.data import dataset_spec
from dynabatch.common.messages import Assignment
from dynabatch.worker.pipeline import Pipeline
from dynabatch.worker.step_times import StepResult, StepTimes

log = logging.getLogger("dynabatch.worker")


@dataclass
class GradientSteps:
    """One worker's gradient steps; `min_versions` carries the ssgd round between steps."""

    worker: "object"
    min_versions: list[int] | None = None
    last_versions: list[int] | None = None
    pipeline: Pipeline | None = None
    finished: bool = False

    def _rounds_done(self, version: int) -> bool:
        """ssgd: has the model had epochs * train_size / B rounds?"""
        job = self.worker.job
        rounds = math.ceil(job.epochs * dataset_spec(job.dataset).train_size / job.global_batch)
        self.finished = job.protocol == "ssgd" and version >= rounds
        return self.finished

    def step(self, assignment: Assignment) -> StepResult | None:
        w = self.worker
        if w.job.pipeline:
            return self._pipelined_step(assignment)
        times = StepTimes()
        start = time.perf_counter()
        pulled = w.shards.pull(self.min_versions, w.opts.request_timeout_s)
        if self.min_versions is not None:
            times.wait = time.perf_counter() - start
        else:
            times.pull = time.perf_counter() - start
        self.last_versions = pulled.shard_versions
        if self._rounds_done(pulled.version):
            return None
        load_flat(w.model, pulled.flat)
        x, y = w.next_batch(assignment.batch)
        loss, times.compute = w.timed_compute(x, y)
        if not math.isfinite(loss):
            log.error("%s: loss is %s; not pushing this step's gradient", w.id, loss)
            return None
        start = time.perf_counter()
        w.shards.push(flat_grads(w.model), pulled.chunk_versions, assignment.batch, loss, w.opts.request_timeout_s)
        times.push = time.perf_counter() - start
        self._next_round(pulled.shard_versions)
        return StepResult(times, assignment.batch, loss, pulled.version)

    def _pipelined_step(self, assignment: Assignment) -> StepResult | None:
        """The same step with pull, compute and push overlapped chunk by chunk (pipeline.py)."""
        w = self.worker
        if self.pipeline is None:
            self.pipeline = Pipeline(w.model, w.layout, w.shards, w.job.max_inflight_bytes, w.opts.request_timeout_s)
        if self.last_versions is not None and self._rounds_done(min(self.min_versions or self.last_versions)):
            return None
        x, y = w.next_batch(assignment.batch)
        wall, cpu = time.perf_counter(), time.thread_time()
        result = self.pipeline.step(x, y, self.min_versions, assignment.batch)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        times = StepTimes(push=result.push_wait_s)
        if self.min_versions is not None:
            times.wait = result.pull_wait_s
        else:
            times.pull = result.pull_wait_s
        times.compute = wall - result.pull_wait_s - result.push_wait_s + w.idle_for_slowdown(cpu)
        self.last_versions = result.pulled.shard_versions
        self._next_round(result.pulled.shard_versions)
        return StepResult(times, assignment.batch, result.loss, result.pulled.version)

    def _next_round(self, pulled_versions: list[int]) -> None:
        """ssgd: the next pull waits for the round this step's gradient went into."""
        if self.worker.job.protocol == "ssgd":
            self.min_versions = [v + 1 for v in pulled_versions]

    def after_failure(self, code: str) -> None:
        """After "already pushed in this round" the next pull must wait for that round; otherwise start over."""
        if code == "bad_state" and self.last_versions is not None:
            self.min_versions = [v + 1 for v in self.last_versions]
        else:
            self.min_versions = None
