"""The default step size (common/base_lr.py): `--lr` left at 0 is the step tuned for the step rule that runs, on
the shards (their SGD, from the job WELCOME carries) and in a worker's local steps; an explicit `--lr` and a task's
optimizer win. Directly, without sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from prometheus_client import CollectorRegistry

from dynabatch.common.base_lr import CONSTANT_STEP_LR, DELAY_STEP_LR, base_lr
from dynabatch.common.config import JobConfig, check_flags_against_task, job_from_dict, to_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.protocol_switch import running, switch_plan
from dynabatch.common.wire.messages import Welcome
from dynabatch.common.wire.model_signature import signature_from_fields
from dynabatch.optim import SGD
from dynabatch.ps.served_job import ServedJob
from dynabatch.scheduler.job_state import JobState
from dynabatch.worker.local_steps import inner_optimizer

SIG = signature_from_fields(["w", "b"], [[30, 10], [10]], ["float32", "float32"], train_size=500)


def _shard(job: JobConfig) -> ServedJob:
    """A shard welcomed into `job` as the scheduler runs it now (its WELCOME's config)."""
    config = to_dict(JobState(replace(job, chunk_bytes=1024), num_shards=1).running_job)
    return ServedJob.welcomed(Welcome(id="ps0", config=config, shards=[], shard_index=0), CollectorRegistry(), "")


def _inner_lr(job: JobConfig, lr_scale: float = 1.0) -> float:
    """A worker's inner step under `job` as it reads it from WELCOME."""
    optimizer = inner_optimizer(None, torch.nn.Linear(3, 2), job_from_dict(to_dict(job)), lr_scale)
    return float(optimizer.param_groups[0]["lr"])


def test_the_default_is_the_delay_steps_under_auto_and_asgds_constant_step_otherwise() -> None:
    assert JobConfig().lr == 0.0, "the flag's default reads as not given"
    assert DELAY_STEP_LR > CONSTANT_STEP_LR
    assert base_lr(JobConfig()) == DELAY_STEP_LR
    assert base_lr(JobConfig(protocol="asgd")) == CONSTANT_STEP_LR
    assert base_lr(JobConfig(protocol="asgd", staleness_step="delay")) == DELAY_STEP_LR
    assert base_lr(JobConfig(protocol="local")) == CONSTANT_STEP_LR
    # a cluster file resolves auto before the shards start, to a protocol named without the delay step
    assert base_lr(JobConfig(cluster_profile="cluster.json")) == CONSTANT_STEP_LR


def test_auto_runs_one_default_on_every_protocol_it_may_switch_to() -> None:
    job = JobConfig()
    protocols = switch_plan(job).protocols
    assert set(protocols) == {"asgd", "ssgd", "local"}
    assert {base_lr(running(job, p)) for p in protocols} == {DELAY_STEP_LR}


def test_the_default_reaches_the_shards_sgd_and_a_workers_local_steps() -> None:
    served = _shard(JobConfig())
    assert served.job.lr == 0.0, "the wire carries the flag as given"
    assert served.new_state(SIG, torch.ones(SIG.total), {}, {}).optimizer.lr == DELAY_STEP_LR
    served.switch("local")
    assert base_lr(served.job) == DELAY_STEP_LR, "a switch keeps the step"
    assert _inner_lr(running(JobConfig(), "local"), 0.5) == pytest.approx(DELAY_STEP_LR * 0.5)
    assert _shard(JobConfig(protocol="asgd")).new_state(SIG, None, {}, {}).optimizer.lr == CONSTANT_STEP_LR
    assert _inner_lr(JobConfig(protocol="local")) == CONSTANT_STEP_LR


def test_an_explicit_lr_wins_everywhere() -> None:
    for job in (JobConfig(lr=0.3), JobConfig(lr=0.3, protocol="asgd")):
        assert _shard(job).new_state(SIG, None, {}, {}).optimizer.lr == 0.3
        assert _inner_lr(replace(job, protocol="local")) == 0.3


def test_a_tasks_optimizer_wins_and_the_default_lr_does_not_conflict_with_it() -> None:
    task = SGD(lr=0.01, momentum=0.9)
    state = _shard(JobConfig()).new_state(SIG, None, task.to_wire(), {})
    assert state.optimizer == task
    check_flags_against_task(JobConfig(), task)  # lr left at its default: nothing set beside the task's
    with pytest.raises(ConfigError, match="--lr: the task names the shards' optimizer"):
        check_flags_against_task(JobConfig(lr=DELAY_STEP_LR), task)


def test_a_negative_lr_is_refused_and_zero_means_the_default() -> None:
    JobConfig(lr=0.0).validate()
    with pytest.raises(ConfigError, match="--lr"):
        JobConfig(lr=-0.1).validate()
