"""The end of the job (scheduler/job_end.py) driven directly: the stop latch and its confirmation by the shards,
the budget, a stall, and the final evaluation."""

from __future__ import annotations

from typing import Any

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.job_end import JobEnd
from dynabatch.scheduler.roster import Member, Roster
from dynabatch.scheduler.saved_progress import SavedProgress


def _end(num_shards: int = 2, **kw: Any) -> tuple[JobEnd, dict[int, Member]]:
    job = JobConfig(**{"dataset": "synthetic", "global_batch": 100, "epochs": 1.0, "join_timeout_s": 30.0, **kw})
    roster = Roster(job, num_shards)
    for _ in range(num_shards):
        roster.register(Hello(role=Role.SHARD), 0.0, b"", lambda: None)
    return JobEnd(job), roster.shards


def _beat(shards: dict[int, Member], version: int = 0) -> None:
    for shard in shards.values():
        shard.heartbeats += 1
        shard.shard_last = ShardHeartbeat(version=version)


def _after_beats(
    end: JobEnd, shards: dict[int, Member], beats: int, epoch: float = 1.0, in_doubt: bool = False
) -> bool:
    """Every shard heartbeats `beats` times (the job latching after each, as after every message); stopping?"""
    for _ in range(beats):
        _beat(shards)
        end.latch(epoch, in_doubt=in_doubt, shards=shards)
    return end.stopping


def test_the_epochs_count_once_every_shard_has_since_reported_twice() -> None:
    end, shards = _end()
    end.latch(0.5, in_doubt=False, shards=shards)
    assert not end.stopping and end.trained_at_beats is None
    end.latch(1.0, in_doubt=False, shards=shards)
    assert not end.stopping and end.trained_at_beats == {0: 0, 1: 0}
    assert not _after_beats(end, shards, 1), "the first heartbeat received after may have been sent before"
    assert _after_beats(end, shards, 1)
    assert _after_beats(end, shards, 1, epoch=0.2, in_doubt=True), (
        "a latch: work lost after the workers were told to stop is not waited for"
    )


def test_a_model_in_doubt_starts_the_confirmation_again() -> None:
    end, shards = _end()
    end.latch(1.0, in_doubt=False, shards=shards)
    assert not _after_beats(end, shards, 1, in_doubt=True) and end.trained_at_beats is None
    assert not _after_beats(end, shards, 2), "counted from when the doubt cleared"
    assert _after_beats(end, shards, 1)


def test_a_spent_budget_or_a_failure_stops_the_job() -> None:
    end, shards = _end(time_budget_s=10.0)
    end.check_budget(100.0, training_started_at=None)
    assert not end.budget_spent, "not training yet"
    end.check_budget(109.0, training_started_at=100.0)
    assert not end.budget_spent
    end.check_budget(110.0, training_started_at=100.0)
    end.latch(0.0, in_doubt=False, shards=shards)
    assert end.budget_spent and end.stopping

    failing, shards = _end()
    failing.fail("")
    assert not failing.failed
    failing.fail("diverged")
    failing.fail("later")
    failing.latch(0.0, in_doubt=True, shards=shards)
    assert failing.failed == "diverged" and failing.stopping


def test_a_job_that_trains_nothing_for_longer_than_its_workers_steps_allow_fails() -> None:
    end, _ = _end(join_timeout_s=5.0)
    worker = Member(
        "w0", Role.WORKER, "w0", "", "", 0.0, 0.0, last=WorkerHeartbeat(times=StepTimes(step_s=0.01), skipped=4)
    )
    end.check_stall(0.0, 100, [worker], training_started=True)
    end.check_stall(4.9, 100, [worker], training_started=True)
    assert not end.failed
    end.check_stall(5.1, 100, [worker], training_started=True)
    assert "no sample trained for 5 s" in end.failed and "skipped 4 steps" in end.failed


def test_the_end_waits_for_workers_and_a_final_evaluation() -> None:
    end, shards = _end(await_final_eval=True)
    for _ in range(3):
        end.latch(1.0, in_doubt=False, shards=shards)
        _beat(shards)
    assert end.stopping
    assert not end.finished(workers_live=True, evaluators=False, final_eval=False)
    assert not end.finished(workers_live=False, evaluators=True, final_eval=False), "its evaluator is at work"
    assert end.finished(workers_live=False, evaluators=True, final_eval=True)
    assert not end.finished(workers_live=False, evaluators=False, final_eval=False), "one may still join"
    assert end.wait_for_final_eval(10.0, evaluators=False, final_eval=False) is False and end.stopped_at == 10.0
    assert end.wait_for_final_eval(40.5, evaluators=False, final_eval=False) is True
    assert end.wait_for_final_eval(41.0, evaluators=False, final_eval=False) is False, "said once"
    assert end.finished(workers_live=False, evaluators=False, final_eval=False)


def test_a_resumed_spent_budget_stops_the_job_at_the_next_latch() -> None:
    end, shards = _end()
    end.restore(SavedProgress(config={}, budget_spent=True))
    assert not end.stopping
    end.latch(0.0, in_doubt=False, shards=shards)
    assert end.stopping
