"""Rollbacks (scheduler/rollbacks.py) driven directly: ordering one, following the shards that apply it,
and when the model is in doubt."""

from __future__ import annotations

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.scheduler.rollbacks import Rollbacks
from dynabatch.scheduler.roster import Roster
from dynabatch.scheduler.saved_progress import SavedProgress


def _rollbacks(num_shards: int = 2, max_rollbacks: int = 2) -> tuple[Rollbacks, Roster]:
    job = JobConfig(dataset="synthetic", max_rollbacks=max_rollbacks)
    roster = Roster(job, num_shards)
    for _ in range(num_shards):
        roster.register(Hello(role=Role.SHARD), 0.0, b"", lambda: None)
    return Rollbacks(job, roster), roster


def _report(rollbacks: Rollbacks, roster: Roster, index: int, hb: ShardHeartbeat) -> None:
    """A shard's heartbeat as the job takes it: recorded, then read."""
    prev, roster.shards[index].shard_last = roster.shards[index].shard_last, hb
    rollbacks.shard_report(index, prev, hb)


def test_a_sick_shard_rolls_the_job_back_and_workers_act_once_every_shard_restored() -> None:
    rollbacks, roster = _rollbacks()
    _report(rollbacks, roster, 0, ShardHeartbeat(version=9, good_version=6, model_problem="norm 1e9"))
    assert rollbacks.divergence.cause and rollbacks.in_doubt
    assert rollbacks.react(3.0, 0.5) == ""
    assert (rollbacks.rollback_number, rollbacks.rollback_done, rollbacks.lr_factor) == (1, 0, 0.5)
    assert rollbacks.rollbacks[-1].versions == {"0": 6, "1": -1} and not rollbacks.divergence.cause
    assert rollbacks.in_doubt, "ordered, applied by no shard"

    _report(rollbacks, roster, 0, ShardHeartbeat(version=6, rollbacks=1))
    assert rollbacks.rollback_done == 0 and not rollbacks.settled and rollbacks.in_doubt
    assert rollbacks.rollbacks[-1].versions["0"] == 6 and not rollbacks.rollbacks[-1].done
    _report(rollbacks, roster, 1, ShardHeartbeat(version=4, rollbacks=1))
    assert rollbacks.settled and rollbacks.rollback_done == 1 and not rollbacks.in_doubt
    assert rollbacks.rollbacks[-1].versions == {"0": 6, "1": 4} and rollbacks.rollbacks[-1].done


def test_settled_only_reads_and_settle_moves_what_workers_are_told() -> None:
    rollbacks, roster = _rollbacks()
    rollbacks.rollback_number = 1
    for shard in roster.shards.values():
        shard.shard_last = ShardHeartbeat(rollbacks=1)
    assert rollbacks.settled and rollbacks.rollback_done == 0, "reading it changes nothing"
    rollbacks.settle()
    assert rollbacks.rollback_done == 1


def test_the_job_gives_up_after_max_rollbacks() -> None:
    rollbacks, roster = _rollbacks(num_shards=1, max_rollbacks=1)
    for _ in range(2):
        _report(rollbacks, roster, 0, ShardHeartbeat(model_problem="nan", rollbacks=rollbacks.rollback_number))
    assert rollbacks.react(1.0, 0.2) == "" and rollbacks.rollback_number == 1
    _report(rollbacks, roster, 0, ShardHeartbeat(rollbacks=1))
    _report(rollbacks, roster, 0, ShardHeartbeat(model_problem="nan", rollbacks=1))
    failure = rollbacks.react(2.0, 0.3)
    assert "after 1 rollback(s)" in failure and "--max-rollbacks 1" in failure
    assert rollbacks.rollback_number == 1


def test_a_shard_that_knows_a_later_rollback_than_a_fresh_scheduler_is_believed() -> None:
    rollbacks, roster = _rollbacks(num_shards=1)
    _report(rollbacks, roster, 0, ShardHeartbeat(rollbacks=2))
    assert rollbacks.rollback_number == rollbacks.rollback_done == 2 and rollbacks.lr_factor == 0.25


def test_worker_reports_count_only_once_the_rollback_is_settled() -> None:
    rollbacks, roster = _rollbacks(num_shards=1)
    rollbacks.rollback_number = 1  # ordered; the shard has not applied it
    prev = WorkerHeartbeat()
    for skipped in (3, 6):
        hb = WorkerHeartbeat(steps=1, skipped=skipped, rollbacks=1)
        rollbacks.worker_report("w0", prev, hb)
        prev = hb
    assert not rollbacks.divergence.cause, "skipped steps of the model thrown away do not count"
    _report(rollbacks, roster, 0, ShardHeartbeat(rollbacks=1))
    hb = WorkerHeartbeat(steps=1, skipped=9, rollbacks=1)
    rollbacks.worker_report("w0", prev, hb)
    assert "w0 skipped 3 steps" in rollbacks.divergence.cause
    rollbacks.forget("w0")
    assert "w0" not in rollbacks.divergence.workers


def test_a_resumed_job_keeps_its_rollbacks_all_applied() -> None:
    rollbacks, roster = _rollbacks(num_shards=1)
    _report(rollbacks, roster, 0, ShardHeartbeat(model_problem="nan"))
    rollbacks.react(1.0, 0.1)
    again, _ = _rollbacks(num_shards=1)
    again.restore(SavedProgress(config={}, rollbacks=list(rollbacks.rollbacks)))
    assert again.rollback_number == again.rollback_done == 1 and again.lr_factor == 0.5
    assert not again.in_doubt
