"""A worker Ringmaster would always discard is idled (common/planning/discarded_workers.py, scheduler/idle_workers.py):
the rule directly, the scheduler's evidence, the allocation and STATUS, and the predictor."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynabatch.cluster.progress import format_progress
from dynabatch.common.planning.discarded_workers import discarded_workers
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.prediction import Cluster, Node, predict
from dynabatch.scheduler.idle_workers import IDLE_AFTER, IdleWorkers
from test_job_state import _job, _join, _shards_apply, _step


def test_a_worker_whose_every_step_reaches_r_is_named_with_its_least_delay() -> None:
    # the two 1 s workers complete 4 whole steps each during one of the 4 s worker's: 8 versions, at least R = 3
    assert {w: d.delay for w, d in discarded_workers({"a": 1.0, "b": 1.0, "c": 4.0}, 3).items()} == {"c": 8}
    assert discarded_workers({"a": 1.0, "b": 1.0, "c": 4.0}, 3)["c"].reason == (
        "Ringmaster would discard its steps: delay 8 >= R 3"
    )


def test_a_worker_some_of_whose_steps_count_is_not_named() -> None:
    # mean delay 2 x 1.5 = 3 reaches R = 3, so some of its steps are discarded; but the others complete only one
    # whole step each within one of its steps, depending on the phase, so its least delay is 2 and some count
    assert discarded_workers({"a": 1.0, "b": 1.0, "c": 1.5}, 3) == {}
    assert discarded_workers({"a": 1.0, "b": 1.0, "c": 1.0}, 3) == {}
    assert discarded_workers({"a": 9.0}, 1) == {}, "the fastest worker is always kept"


def test_a_worker_comes_back_when_a_faster_one_leaves_or_the_others_slow_down() -> None:
    r = 4  # --max-delay 4: R does not follow the workers
    assert set(discarded_workers({"a": 1.0, "b": 1.0, "c": 2.5}, r)) == {"c"}  # least delay 2 + 2
    assert discarded_workers({"a": 1.0, "c": 2.5}, r) == {}, "b left: 2 versions during its step"
    assert discarded_workers({"a": 1.5, "b": 1.5, "c": 2.5}, r) == {}, "the others slowed: 1 + 1 versions"


def test_the_scheduler_idles_a_named_worker_only_once_its_own_reports_agree_and_judges_it_again() -> None:
    idle, steps = IdleWorkers(), {"a": 1.0, "b": 1.0, "c": 4.0}
    idle.report("c", steps=5, discarded=0)
    idle.report("c", steps=5, discarded=IDLE_AFTER - 1)
    assert not idle.judge(steps, 3) and idle.reason("c") == "", "not enough discarded steps in a row yet"
    idle.report("c", steps=6, discarded=IDLE_AFTER + 1)  # a step was applied: the count starts again
    assert not idle.judge(steps, 3)
    idle.report("c", steps=6, discarded=2 * IDLE_AFTER + 1)
    assert idle.judge(steps, 3) and idle.reason("c").startswith("Ringmaster would discard its steps")
    assert not idle.judge(steps, 3) and "c" in idle.idle, "idle, it stays idle while the rule names it"
    assert idle.judge({**steps, "a": 3.0, "b": 3.0}, 3) and idle.idle == {}, "the others slowed: it is back"
    assert not idle.judge(steps, 3), "back, it needs fresh evidence before it is idled again"
    idle.report("c", steps=6, discarded=3 * IDLE_AFTER + 1)
    assert idle.judge(steps, 3) and "c" in idle.idle
    assert idle.judge(None, 3) and idle.idle == {}, "the job switched away from Ringmaster: none is idle"
    idle.forget("c")
    assert idle.discarded_in_a_row("c") == 0


def test_a_ringmaster_job_gives_an_always_discarded_worker_no_batch_says_why_and_takes_it_back() -> None:
    state = _job(protocol="ringmaster", batch_policy="fixed", max_delay=3, epochs=1000.0)
    fast = [_join(state, 1000.0), _join(state, 1000.0)]
    slow = _join(state, 250.0)
    now = 0.0
    for _ in range(3):
        now += 0.2
        for wid in fast:
            _step(state, wid, 0.05, now)
        _step(state, slow, 0.2, now)
    assert state.allocator.batch_of(slow) > 0, "applied steps: it trains"
    last = state.roster.members[slow].last
    for n in range(1, IDLE_AFTER + 1):
        now += 0.2
        state.heartbeat(slow, replace(last, discarded=n), now)  # its steps are discarded from now on
        for wid in fast:
            _step(state, wid, 0.05, now)
        _shards_apply(state, now)
    assert state.allocator.allocation == {fast[0]: 32, fast[1]: 32, slow: 0}, "the others keep their batches"
    shown = state.status(now).workers[slow]
    assert shown.batch == 0 and shown.idle == "Ringmaster would discard its steps: delay 8 >= R 3"
    assert "idle (Ringmaster would discard its steps: delay 8 >= R 3)" in format_progress(state.status(now), now)
    decision = state.allocator.decisions[-1]
    assert decision.reason.endswith("; idle: Ringmaster would discard their steps") and decision.batches[slow] == 0
    assert state.expire(now + 1.0) == [] and not state.roster.members[slow].left, "idle, not dropped"
    for _ in range(20):  # the fast workers slow to 0.15 s a step: 2 x 1 whole step during one of its 0.2 s
        now += 0.2
        for wid in fast:
            _step(state, wid, 0.15, now)
        state.heartbeat(slow, replace(last, discarded=IDLE_AFTER), now)
        _shards_apply(state, now)
    assert state.allocator.batch_of(slow) > 0 and state.status(now).workers[slow].idle == ""


def test_the_predictor_idles_the_worker_ringmaster_would_discard_and_counts_nothing_of_it() -> None:
    gpu, slow = Device(0.02, 0.0005), Device(0.2, 0.005)
    mixed = Cluster((Node(gpu),) * 3 + (Node(slow),), 256)
    ring = predict(mixed, STUDY_NOISE, "ringmaster", "fixed")
    assert ring.batches == (64, 64, 64, 0) and ring.step_s[3] == 0, "idle; the others keep their batches"
    assert ring.discarded == 0, "the idle worker computes nothing, so nothing computed is discarded"
    fast_alone = predict(Cluster((Node(gpu),) * 3, 192), STUDY_NOISE, "ringmaster", "fixed")
    assert ring.samples_per_s == pytest.approx(fast_alone.samples_per_s), "its throughput counts for nothing"
    assert ring.time_s == pytest.approx(fast_alone.time_s)
