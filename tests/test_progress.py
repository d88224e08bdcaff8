"""Progress (scheduler/progress.py) driven directly: samples that survive departures, lost work, the loss,
and a resumed count checked against the shards."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.scheduler.progress import LOSS_SMOOTHING, Progress
from dynabatch.scheduler.roster import Member, Roster
from dynabatch.scheduler.saved_progress import SavedProgress


def _progress(num_shards: int = 1, **kw: Any) -> tuple[Progress, Roster]:
    job = JobConfig(**{"dataset": "synthetic", "global_batch": 96, "min_batch": 8, **kw})
    roster = Roster(job, num_shards)
    for _ in range(num_shards):
        roster.register(Hello(role=Role.SHARD), 0.0, b"", lambda: None)
    return Progress(job, roster, train_size=1000, started=10.0), roster


def _worker(roster: Roster, samples: int, bytes_: int = 0, staleness: list[int] | None = None) -> Member:
    member = roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    roster.admit_worker(member)
    member.samples = samples
    member.last = WorkerHeartbeat(samples=samples, bytes=bytes_, staleness=staleness or [])
    return member


def test_samples_count_live_workers_and_those_that_left() -> None:
    progress, roster = _progress()
    a = _worker(roster, 480, bytes_=100, staleness=[5])
    _worker(roster, 96, bytes_=10, staleness=[0, 1])
    assert progress.samples == 576 and progress.epoch == pytest.approx(0.576) and progress.bytes == 110
    assert progress.staleness_counts == [5, 1]
    roster.leave(a)
    assert progress.samples == 96, "until its counts are kept"
    progress.worker_left(a)
    assert progress.samples == 576 and progress.bytes == 110 and progress.staleness_counts == [5, 1]
    assert progress.t(12.5) == 2.5


def test_a_shard_back_from_an_older_checkpoint_counts_its_lost_samples_back() -> None:
    progress, roster = _progress()
    _worker(roster, 480)
    progress.shard_report(0, ShardHeartbeat(version=5, samples=480, train_size=2000))
    assert progress.train_size == 2000 and progress.lost_samples == 0
    progress.shard_report(0, ShardHeartbeat(version=2, samples=192))
    assert (progress.lost_versions, progress.lost_samples) == (3, 288)
    assert [(lost.shard, lost.versions, lost.samples) for lost in progress.losses] == [(0, 3, 288)]
    assert progress.kept_samples == 192 and progress.epoch == pytest.approx(192 / 2000)
    progress.shard_report(0, ShardHeartbeat(version=2, samples=192, train_size=1 << 41))
    assert progress.train_size == 2000, "a training set size that cannot be is ignored"


def test_the_loss_is_smoothed_over_finite_reports() -> None:
    progress, _ = _progress()
    progress.observe_loss(math.inf)
    assert math.isnan(progress.loss)
    progress.observe_loss(2.0)
    progress.observe_loss(1.0)
    assert progress.loss == pytest.approx(LOSS_SMOOTHING * 2.0 + (1 - LOSS_SMOOTHING) * 1.0)


def test_no_shard_can_be_past_what_the_samples_allow() -> None:
    progress, roster = _progress()
    _worker(roster, 80)
    assert progress.newest_possible_version == 80 // 8 + 2 + 1, "a push on its way, a last one below --min-batch"
    roster.shards[0].shard_last = ShardHeartbeat(version=50)
    assert progress.newest_possible_version == 50


def test_a_resumed_count_beyond_what_the_shards_hold_is_cut_back_once_every_shard_reported() -> None:
    progress, roster = _progress(num_shards=2)
    progress.restore(SavedProgress(config={}, t=7.0, samples=4800, lost_samples=0, train_size=1000), now=20.0)
    assert progress.started == 13.0 and progress.samples == 4800
    progress.shard_report(0, ShardHeartbeat(version=5, samples=480))
    assert progress.samples == 4800, "shard 1 has not reported yet"
    progress.shard_report(1, ShardHeartbeat(version=4, samples=400))
    assert progress.samples == 480 + 96, "the most any shard holds, and one global batch in flight"
    progress.shard_report(1, ShardHeartbeat(version=4, samples=0))
    assert progress.samples == 576, "checked once"
