"""The worker's protocol loops driven directly, against a real scheduler and shard on 127.0.0.1.

A loop sees its worker only through a `StepContext`; here the context is built by
hand (model, synthetic data, real shard clients), so each step's pulls, pushes and
recovery can be checked without a whole worker process around it. The batch
source's replay of a failed step's samples is pure logic and tested on its own.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zmq

from dynabatch.common.config import JobConfig
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.tasks.data import SampleOrder, load_dataset, make_batch
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import Layout, make_layout
from dynabatch.common.wire.messages import WorkerAssignment
from dynabatch.task import cross_entropy
from dynabatch.worker.batch_source import BatchSource
from dynabatch.worker.gradient_steps import GradientLoop
from dynabatch.worker.ps_client import ShardClients
from dynabatch.worker.step_context import StepContext, StepLoop
from dynabatch.worker.step_result import StepResult
from harness import Cluster

TIMEOUT_S = 30.0


def test_a_failed_steps_samples_are_replayed_in_order_and_a_successful_steps_never() -> None:
    source = BatchSource(SampleOrder(100, seed=1))
    first, second = source.take(8), source.take(8)
    source.step_failed()
    assert torch.equal(source.take(8), first) and torch.equal(source.take(8), second)
    source.step_succeeded()
    source.step_failed()
    fresh = source.take(8)
    assert not torch.equal(fresh, first) and not torch.equal(fresh, second)


def test_a_replay_of_another_batch_size_is_dropped_for_fresh_samples() -> None:
    """The assignment changed while the step failed: the order moves on instead of mixing sizes."""
    source = BatchSource(SampleOrder(100, seed=2))
    lost = source.take(8)
    source.step_failed()
    taken = source.take(16)
    assert len(taken) == 16 and not set(lost.tolist()) & set(taken.tolist())
    assert source.replay == []


def _context(job: JobConfig, shards: ShardClients, layout: Layout, model: torch.nn.Module) -> StepContext:
    data = load_dataset("synthetic")
    source = BatchSource(SampleOrder(len(data.train_y), seed=0))

    def compute(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        start = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss = cross_entropy(model, batch)
        torch.autograd.backward(loss)
        return float(loss.detach()), time.perf_counter() - start

    return StepContext(
        job=job,
        model=model,
        layout=layout,
        shards=shards,
        request_timeout_s=TIMEOUT_S,
        next_batch=lambda b: make_batch(data, source.take(b), True),
        timed_compute=compute,
        loss_fn=cross_entropy,
        idle_for_slowdown=lambda cpu_s: 0.0,
        heartbeat_when_due=lambda: None,
        skip_step=lambda loss: None,
    )


def _cluster(tmp_path: Path, protocol: str, epochs: str = "1000") -> Cluster:
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--protocol",
            protocol,
            "--epochs",
            epochs,
            "--liveness-timeout-s",
            "60",
            "--round-timeout-s",
            "60",
        ],
    )
    c.scheduler()
    c.shard(0)
    return c


def _worker(c: Cluster, job: JobConfig) -> tuple[ShardClients, StepContext]:
    """A registered test worker (holding a batch) with its own shard clients and step context.

    Its first push may reach the shard before the shard has heard of it; the shard
    clients resend such a push until the shard knows the worker, as in a real worker.
    """
    _conn, welcome = c.join_as_worker()
    model = model_for_job(job)
    layout = make_layout(sum(p.numel() for p in model.parameters()), job.chunk_bytes, job.shards)
    shards = ShardClients(zmq.Context.instance(), welcome.shards, layout, job.job, welcome.id)
    return shards, _context(job, shards, layout, model)


def _step(loop: StepLoop, batch: int) -> StepResult:
    result = loop.step(WorkerAssignment(assignment_id=1, batch=batch))
    assert result is not None, "a step was taken"
    return result


@pytest.mark.slow
def test_gradient_steps_with_push_pull_prefetching_and_pushing_behind_each_push_one_update(tmp_path: Path) -> None:
    """Three workers of one job, one per way of stepping (tests of ssgd cover the plain push). push_pull (the
    default): the push's answer is the model the next step computes on, the one a pull would get. prefetch_pull: the
    next pull leaves before compute, so the second step's model lacks the first step's own gradient; with
    push_behind too, a push is acknowledged only before the next one leaves."""
    job = JobConfig(dataset="synthetic", model="mlp", protocol="asgd")
    c = _cluster(tmp_path, "asgd")
    try:
        shards, ctx = _worker(c, job)
        before = shards.pull(None, TIMEOUT_S).flat.clone()
        loop = GradientLoop(ctx)
        result = _step(loop, 32)
        assert result.batch == 32 and result.steps == 1 and result.version == 0
        assert loop.pulled is not None
        brought = loop.pulled.flat.clone()
        after = shards.pull(None, TIMEOUT_S)
        assert after.version == 1 and not torch.equal(after.flat, before)
        assert loop.min_versions is None, "an asynchronous step never waits for a version"
        assert torch.equal(brought, after.flat) and loop.pulled.version == 1
        assert _step(loop, 32).version == 1, "the second step computes on the model its push brought back"
        assert loop.pulled is not None and loop.pulled.version == 2
        loop.after_failure("timeout")
        assert loop.pulled is None, "after a failure the next step pulls afresh"

        shards, ctx = _worker(c, replace(job, prefetch_pull=True))
        ahead = GradientLoop(ctx)
        assert _step(ahead, 32).version == 2
        assert ahead.ahead is not None and ahead.ahead.done(), "the push's wait took in the prefetched chunks"
        assert _step(ahead, 32).version == 2, "one more version of staleness: the pull left before the first push"
        assert shards.pull(None, TIMEOUT_S).version == 4
        ahead.after_failure("timeout")
        assert ahead.ahead is None

        shards, ctx = _worker(c, replace(job, prefetch_pull=True, push_behind=True))
        behind = GradientLoop(ctx)
        assert _step(behind, 32).version == 4 and behind.unacked is not None
        first = behind.unacked
        assert _step(behind, 32).version == 4 and first.done() and behind.unacked is not first, (
            "the first push was acknowledged before the second left"
        )
        shards.finish_push(behind.unacked, TIMEOUT_S)
        assert shards.pull(None, TIMEOUT_S).version == 6
    finally:
        c.stop()


@pytest.mark.slow
def test_a_round_step_waits_for_the_round_it_pushed_into(tmp_path: Path) -> None:
    """ssgd with one worker: every push closes a round, and the next pull asks for the version it made. The loop
    does not count rounds to end: the scheduler's allotment of the job's samples does (scheduler/allocator.py)."""
    job = JobConfig(dataset="synthetic", model="mlp", protocol="ssgd", global_batch=64)
    c = _cluster(tmp_path, "ssgd")
    try:
        _shards, ctx = _worker(c, job)
        loop = GradientLoop(ctx)
        first = _step(loop, 64)
        assert first.version == 0 and loop.min_versions == [1]
        second = _step(loop, 64)
        assert second.version == 1 and loop.min_versions == [2]
    finally:
        c.stop()


@pytest.mark.slow
def test_a_round_step_refused_as_a_second_push_waits_for_that_round(tmp_path: Path) -> None:
    """A push resent after a timeout that had in fact arrived is refused (`bad_state`); the loop then
    waits for the round it is already in instead of pushing into it again. (Without push_pull: this test
    drives both workers from one thread, and a push that also pulls would wait for the other's push.)"""
    job = JobConfig(dataset="synthetic", model="mlp", protocol="ssgd", push_pull=False)
    c = _cluster(tmp_path, "ssgd")
    try:
        _shards0, ctx0 = _worker(c, job)
        shards1, ctx1 = _worker(c, job)
        loop = GradientLoop(ctx0)
        assert _step(loop, 32).version == 0
        loop.after_failure("timeout")  # as if the push's acknowledgement had been lost
        with pytest.raises(RemoteError, match="bad_state"):
            _step(loop, 32)
        loop.after_failure("bad_state")
        assert loop.min_versions == [1]
        other = _step(GradientLoop(ctx1), 32)
        assert other.version == 0
        assert _step(loop, 32).version == 1, "the round closed with both"
    finally:
        c.stop()
