"""Allocation (scheduler/allocator.py) driven directly: speed models, the split, the batch each worker holds,
local steps, and what a restart keeps."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from dynabatch.common.allotment import allotted_batch
from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.allocator import (
    ALLOT_AHEAD,
    DECISIONS_KEPT,
    HANDED_KEPT,
    Allocator,
    levelled,
    own_compute_seconds,
    own_step_seconds,
    shares,
)
from dynabatch.scheduler.batch_allocation import allocate
from dynabatch.scheduler.saved_progress import SavedProgress, SavedSpeed
from dynabatch.scheduler.speed_model import StepModel


def _allocator(**kw: Any) -> Allocator:
    job = JobConfig(**{"dataset": "synthetic", "global_batch": 96, "protocol": "asgd", "batch_policy": "dynamic", **kw})
    return Allocator(job, protocol_spec(job.protocol))


def _measured(allocator: Allocator, speeds: dict[str, float]) -> dict[str, int]:
    for wid, sps in speeds.items():
        allocator.measure(wid, sps, instance="")
    return {wid: 0 for wid in speeds}


def test_the_split_follows_standalone_speeds_and_says_who_was_given_a_batch() -> None:
    allocator = _allocator()
    ready = _measured(allocator, {"w0": 3000.0, "w1": 1000.0})
    assert allocator.reallocate(5.0, 2.0, "joined", "w1", ready, force=True) == ["w0", "w1"]
    assert allocator.allocation == {"w0": 72, "w1": 24} and allocator.training_started_at == 5.0
    assert allocator.assignment_id == 1 and allocator.decisions[-1].t == 2.0
    assert allocator.decisions[-1].reason.startswith("joined") and allocator.decisions[-1].subject == "w1"
    assert allocator.reallocate(6.0, 3.0, "speed update", "w0", ready) == [], "nothing changed: no decision"
    assert allocator.assignment_id == 1 and allocator.training_started_at == 5.0


def test_a_workers_own_largest_batch_caps_its_share() -> None:
    allocator = _allocator()
    ready = _measured(allocator, {"w0": 3000.0, "w1": 1000.0})
    ready["w0"] = 40
    allocator.reallocate(0.0, 0.0, "joined", "w0", ready, force=True)
    assert allocator.allocation["w0"] <= 40 and sum(allocator.allocation.values()) == 96


def test_no_split_before_min_workers_are_ready_and_a_reset_keeps_the_previous_one() -> None:
    allocator = _allocator(min_workers=2)
    ready = _measured(allocator, {"w0": 1000.0})
    assert allocator.reallocate(0.0, 0.0, "joined", "w0", ready, force=True) == []
    assert allocator.allocation == {} and not allocator.training_started
    ready = _measured(allocator, {"w0": 1000.0, "w1": 1000.0})
    allocator.reallocate(1.0, 1.0, "joined", "w1", ready, force=True)
    assert allocator.allocation == {"w0": 48, "w1": 48}
    assert allocator.reallocate(2.0, 2.0, "left", "w0", {}, force=True) == []
    assert allocator.allocation == {}


def test_a_worker_holds_no_more_than_every_shard_was_told_it_may_push() -> None:
    allocator = _allocator()
    ready = _measured(allocator, {"w0": 1000.0, "w1": 1000.0})
    allocator.reallocate(0.0, 0.0, "joined", "w1", ready, force=True)
    assert allocator.batch_of("w0") == 48, "no shard answered yet: none is waited on"
    allocator.answered(0)
    assert allocator.batch_of("w0") == 0, "shard 0 was answered: it holds w0 back until it reports w0's bound"
    allocator.tell(0, allocator.push_bounds(["w0", "w1"]))
    allocator.tell(1, {})
    assert allocator.batch_of("w0") == 0, "shard 1 was told nothing of w0"
    allocator.tell(1, allocator.push_bounds(["w0", "w1"]))
    assert allocator.batch_of("w0") == 48
    allocator.forget("w1")
    allocator.reallocate(1.0, 1.0, "left", "w1", {"w0": 0}, force=True)
    assert allocator.allocation == {"w0": 96}
    assert allocator.push_bounds(["w0"]) == {"w0": 96}, "a live worker only, by its new allocation"
    allocator.tell(0, allocator.push_bounds(["w0"]))
    assert allocator.batch_of("w0") == 48, "shard 1 still bounds it by 48"
    allocator.forget_shard(1)
    assert allocator.batch_of("w0") == 96, "a shard slot whose process left holds nobody back"
    assert allocator.batch_of("w9") == 0


def test_a_workers_push_bound_keeps_every_batch_handed_since_its_last_reported_step_and_stays_small() -> None:
    allocator = _allocator(batch_policy="fixed")
    handed = []
    for i in range(HANDED_KEPT + 5):  # w0's share alternates between 96 and 48, one decision each, no step reported
        ready = _measured(allocator, {f"w{j}": 1000.0 for j in range(1 + i % 2)})
        allocator.reallocate(float(i), float(i), "joined", "w0", ready, force=True)
        allocator.hand("w0", allocator.batch_of("w0"))
        handed.append(allocator.assignment_id)
    assert len(allocator.handed["w0"]) == HANDED_KEPT
    assert allocator.push_bounds(["w0", "w1"]) == {"w0": 96}, "w1 is out of the last allocation and was handed none"
    allocator.stepped("w0", handed[-1])
    assert allocator.push_bounds(["w0"]) == {"w0": 96}, "its last batch, 96, is still in use"
    allocator.hand("w0", 0)
    assert allocator.push_bounds(["w0"])["w0"] == 96, "a step under an assignment does not end it: a later one does"
    ready = _measured(allocator, {"w0": 1000.0, "w1": 1000.0})
    allocator.reallocate(99.0, 99.0, "joined", "w1", ready, force=True)
    allocator.hand("w0", 48)
    allocator.stepped("w0", allocator.assignment_id)
    assert allocator.push_bounds(["w0", "w1"]) == {"w0": 48, "w1": 48}
    allocator.stepped("w0", allocator.assignment_id + 5)
    assert allocator.handed["w0"] == {allocator.assignment_id: 48}, "a step claimed under a future assignment is not"
    allocator.forget("w0")
    assert "w0" not in allocator.handed


def test_decisions_are_bounded_and_each_is_an_assignment() -> None:
    allocator = _allocator(batch_policy="fixed")
    for i in range(DECISIONS_KEPT + 5):
        ready = _measured(allocator, {f"w{j}": 1000.0 for j in range(1 + i % 2)})
        allocator.reallocate(float(i), float(i), "joined", "w0", ready, force=True)
    assert allocator.assignment_id == DECISIONS_KEPT + 5 and len(allocator.decisions) == DECISIONS_KEPT


def test_a_steps_wait_for_others_is_not_the_workers_own_time() -> None:
    assert own_step_seconds(WorkerHeartbeat(times=StepTimes(step_s=0.5, wait_s=0.3, data_s=0.1))) == 0.2
    assert own_step_seconds(WorkerHeartbeat(times=StepTimes(step_s=0.5, wait_s=0.6))) > 0


def test_adacomm_shrinks_h_as_the_loss_falls_from_the_first_one_it_saw() -> None:
    allocator = _allocator(protocol="msd", local_steps=8)
    workers = [WorkerHeartbeat(sync_s=0.0, times=StepTimes(compute_s=0.1))]
    allocator.adapt_local_steps(1.0, math.nan, workers)
    assert allocator.first_loss is None and allocator.local_steps == 8, "no loss yet"
    allocator.adapt_local_steps(1.0, 4.0, workers)
    assert allocator.first_loss == 4.0 and allocator.local_steps == 8 and allocator.assignment_id == 0
    allocator.adapt_local_steps(2.0, 1.0, workers)
    assert allocator.local_steps == 4 and allocator.assignment_id == 1
    assert allocator.decisions[-1].reason == "local steps" and allocator.decisions[-1].subject.startswith("H=4")


def test_speed_models_are_saved_by_process_and_restored_for_the_same_process() -> None:
    allocator = _allocator(max_workers=2)
    allocator.measure("w0", 1000.0, instance="proc-a")
    allocator.observe("w0", WorkerHeartbeat(batch=32, times=StepTimes(step_s=0.05)))
    saved = allocator.saved_speeds({"proc-a": ("w0", 1000.0), "proc-gone": ("w7", 500.0)})
    assert saved == {"proc-a": SavedSpeed(1000.0, [(32, 0.05)])}, "a worker without a model saves none"

    again = _allocator(max_workers=2)
    again.restore(
        SavedProgress(config={}, assignment_id=7, local_steps=3, local_steps_reason="r", first_loss=2.0, speeds=saved),
        training_started_at=None,
    )
    assert (again.assignment_id, again.local_steps, again.first_loss) == (7, 3, 2.0)
    assert not again.training_started
    again.measure("w3", 1000.0, instance="proc-a")
    assert again.speeds["w3"].window() == [(32, 0.05)] and again.resumed_speeds == {}
    assert again.saved_speeds({}) == {}, "claimed: saved under the process's new id only"


def _one_step_each(allocator: Allocator, transfers_s: dict[str, float], compute_s: dict[str, float]) -> dict[str, int]:
    """Every worker measured at 1000 samples/s, its first batch handed out, then one step of it reported: its
    transfers (`transfers_s`, pull and push) and its compute (`compute_s`, 0: not reported, an older worker)."""
    ready = _measured(allocator, {wid: 1000.0 for wid in transfers_s})
    allocator.reallocate(0.0, 0.0, "joined", "w0", ready, force=True)
    for wid, transfers in transfers_s.items():
        b, compute = allocator.allocation[wid], compute_s[wid]
        allocator.observe(
            wid,
            WorkerHeartbeat(
                batch=b,
                times=StepTimes(
                    step_s=transfers + b * 1e-3, compute_s=compute * b, pull_s=transfers / 2, push_s=transfers / 2
                ),
            ),
        )
    allocator.reallocate(1.0, 1.0, "speed update", "w2", ready)
    return allocator.allocation


def test_an_asynchronous_split_gives_a_slow_links_worker_its_compute_share_from_its_first_step() -> None:
    """w2's steps are 150 ms of transfers and 32 ms of compute: at one batch size its step fit cannot separate
    the two, so the split by the fit's c alone would give it a throughput share (about a sixth); the compute time
    it reports gives it its compute share, a third, from the first step."""
    allocator = _allocator(protocol="asgd", global_batch=96)
    transfers = {"w0": 0.005, "w1": 0.005, "w2": 0.150}
    assert _one_step_each(allocator, transfers, {w: 1e-3 for w in transfers}) == {"w0": 32, "w1": 32, "w2": 32}
    fit = allocator.speeds["w2"].fit()
    assert fit is not None and fit.per_sample_s > 5e-3, "the step fit's c still holds the transfers"
    old = _one_step_each(_allocator(protocol="asgd", global_batch=96), transfers, {"w0": 1e-3, "w1": 1e-3, "w2": 0})
    assert old["w2"] < 16, "no compute time reported: the step fit's c, transfers included"


def test_an_equal_step_split_still_equalizes_whole_steps() -> None:
    """ssgd's rounds wait for the slowest: the slow link's worker gets a smaller batch, compute time or not."""
    transfers = {"w0": 0.005, "w1": 0.005, "w2": 0.150}
    with_compute = _one_step_each(_allocator(protocol="ssgd"), transfers, {w: 1e-3 for w in transfers})
    without = _one_step_each(_allocator(protocol="ssgd"), transfers, {w: 0.0 for w in transfers})
    assert with_compute == without and with_compute["w2"] < 16


def test_a_workers_compute_time_includes_taking_its_samples_and_zero_means_not_reported() -> None:
    assert (
        own_compute_seconds(WorkerHeartbeat(times=StepTimes(step_s=0.5, compute_s=0.2, data_s=0.05, pull_s=0.25)))
        == 0.25
    )
    assert own_compute_seconds(WorkerHeartbeat(times=StepTimes(step_s=0.5, pull_s=0.5))) is None
    assert own_compute_seconds(WorkerHeartbeat(times=StepTimes(step_s=0.5, compute_s=0.9, wait_s=0.2))) == 0.3, (
        "no more than its own step"
    )


def _fixed_pair(**kw: Any) -> Allocator:
    """w0 and w1 hold 48 each (fixed batches, B = 96)."""
    allocator = _allocator(batch_policy="fixed", **kw)
    allocator.reallocate(0.0, 0.0, "joined", "w1", _measured(allocator, {"w0": 1000.0, "w1": 1000.0}), force=True)
    return allocator


def test_each_worker_is_allotted_a_lead_of_pushes_while_the_budget_lasts() -> None:
    allocator = _fixed_pair()
    allocator.allot("w0", {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}, budget=10_000)
    assert allocator.allotted == {"w0": ALLOT_AHEAD * 48, "w1": 0}, "w1 is allotted at its own answer"
    assert allocator.unallotted == 10_000 - ALLOT_AHEAD * 48 and allocator.batch_of("w0") == 48
    allocator.allot("w1", {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}, budget=10_000)
    allocator.allot("w0", {"w0": 96, "w1": 0}, {"w0": 2, "w1": 0}, budget=10_000)
    assert allocator.allotted == {"w0": 96 + ALLOT_AHEAD * 48, "w1": ALLOT_AHEAD * 48}
    assert allocator.batch_of("w1") == 48 and allocator.idle_workers() == []


def test_the_last_of_the_budget_is_split_at_once_and_the_last_batches_are_what_is_left() -> None:
    allocator = _fixed_pair()
    allocator.allot("w0", {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}, budget=300)
    assert allocator.allotted == {"w0": 150, "w1": 150} and allocator.unallotted == 0, (
        "what no longer covers every lead is split at once, in proportion to what each lacks"
    )
    allocator.allot("w0", {"w0": 144, "w1": 48}, {"w0": 3, "w1": 1}, budget=300)
    assert allocator.batch_of("w0") == 6 and allocator.batch_of("w1") == 48
    allocator.allot("w0", {"w0": 150, "w1": 48}, {"w0": 4, "w1": 1}, budget=300)
    assert allocator.batch_of("w0") == 0 and allocator.idle_workers() == ["w0"], "no round waits for it"
    assert allocator.allotted["w0"] == 150, "an allotment never grows past the budget"


def test_what_a_worker_that_left_or_was_left_out_did_not_train_goes_back_to_the_others() -> None:
    allocator = _fixed_pair()
    allocator.allot("w0", {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}, budget=300)
    allocator.forget("w1")  # it left having trained nothing: the job's budget is still 300
    allocator.allot("w0", {"w0": 150}, {"w0": 4}, budget=300)
    assert allocator.allotted == {"w0": 300} and allocator.batch_of("w0") == 48
    allocator = _fixed_pair()
    allocator.allot("w0", {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}, budget=300)
    allocator.allocation = {"w0": 96, "w1": 0}  # w1 left out (a round protocol's slowest): it holds no batch
    allocator.allot("w0", {"w0": 0, "w1": 20}, {"w0": 0, "w1": 1}, budget=300)
    assert allocator.allotted == {"w0": 280, "w1": 20} and allocator.batch_of("w0") == 96


def test_after_a_switch_to_rounds_a_lead_counts_in_rounds_of_the_new_protocol() -> None:
    """Under asgd w0 trained 9,000 samples while w1 trained 1,000 at its own pace; `--protocol auto` then switches
    them to ssgd, whose rounds take a push of each. Each is allotted its lead of pushes from where it stands, and
    the last of the budget is levelled in rounds since the switch: the 8,000 samples w0 is ahead are no rounds w1
    must catch up on alone while w0 idles."""
    allocator = _fixed_pair()
    samples, steps = {"w0": 9000, "w1": 1000}, {"w0": 180, "w1": 20}
    allocator.switch(protocol_spec("ssgd"), steps)
    for worker in samples:
        allocator.allot(worker, samples, steps, budget=15_000)
    assert allocator.allotted == {"w0": 9000 + ALLOT_AHEAD * 48, "w1": 1000 + ALLOT_AHEAD * 48}
    ending = _fixed_pair()
    ending.switch(protocol_spec("ssgd"), steps)
    ending.allot("w0", samples, steps, budget=10_200)
    assert ending.unallotted == 0 and ending.allotted == {"w0": 9104, "w1": 1096}, (
        "the last 200 samples in whole pushes of 48, a round at a time since the switch, the last cut to what is left"
    )


def test_a_local_round_takes_its_last_samples_in_its_h_steps() -> None:
    allocator = _allocator(batch_policy="fixed", protocol="local", local_steps=8)
    allocator.reallocate(0.0, 0.0, "joined", "w0", _measured(allocator, {"w0": 1000.0}), force=True)
    allocator.allot("w0", {"w0": 0}, {"w0": 0}, budget=1000)
    assert allocator.allotted == {"w0": 1000}
    assert allocator.batch_of("w0") == 63, "1000 is a round of 8 x 96 and 232: shared, 63 a step, not 96 then 29"
    allocator.allot("w0", {"w0": 8 * 63}, {"w0": 8}, budget=1000)
    assert allocator.batch_of("w0") == 62, "496 left in 8 steps: 62 each, passing the budget by fewer than 8"


def test_a_batch_is_what_the_allotment_leaves() -> None:
    assert allotted_batch(48, None) == 48, "no budget known yet"
    assert [allotted_batch(48, left) for left in (100, 48, 6, 0, -3)] == [48, 48, 6, 0, 0]
    assert [allotted_batch(48, left, steps=8) for left in (1000, 100, 6)] == [48, 13, 2], "never below the floor"


def test_the_last_of_the_budget_never_leaves_a_worker_a_batch_of_one() -> None:
    """48 each, 97 samples left: the split gives one worker 49, which it trains as 25 and 24, not 48 and 1 (a batch a
    BatchNorm model cannot train on) nor 47 and 2; the job still trains its 97 samples, none past them."""
    allocator = _fixed_pair()
    samples, steps = {"w0": 0, "w1": 0}, {"w0": 0, "w1": 0}
    for worker in samples:
        allocator.allot(worker, samples, steps, budget=97)
    assert sorted(allocator.allotted.values()) == [48, 49] and allocator.unallotted == 0
    trained: dict[str, list[int]] = {"w0": [], "w1": []}
    for worker in itertools.cycle(samples):
        allocator.allot(worker, samples, steps, budget=97)
        batch = allocator.batch_of(worker)
        if batch:
            trained[worker].append(batch)
            samples[worker] += batch
            steps[worker] += 1
        if not any(allocator.batch_of(w) for w in samples):
            break
    assert sorted(trained.values()) == [[25, 24], [48]] and sum(samples.values()) == 97, trained


def test_shares_are_proportional_whole_and_never_above_a_weight() -> None:
    assert shares(5, {"a": 3, "b": 3}) in ({"a": 3, "b": 2}, {"a": 2, "b": 3})
    assert shares(10, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert shares(7, {"a": 10, "b": 0, "c": 4}) == {"a": 5, "b": 0, "c": 2}
    assert shares(3, {"a": 0}) == {"a": 0}


def test_the_efficient_policy_amortises_a_slow_links_transfers_over_a_larger_batch_from_its_first_step() -> None:
    """w2's steps carry 150 ms of transfers, the others' 5 ms, each computing 1 ms a sample: every knee is beyond
    what B = 96 holds, so every worker gets the same fixed share of its step, w2 thirty times the others' batch
    but for their lower bound (8): the transfers its heartbeat reports are its fixed cost from the first step."""
    allocator = _allocator(protocol="asgd", global_batch=96, batch_policy="efficient")
    transfers = {"w0": 0.005, "w1": 0.005, "w2": 0.150}
    assert _one_step_each(allocator, transfers, {w: 1e-3 for w in transfers}) == {"w0": 8, "w1": 8, "w2": 80}


def test_round_workers_whose_reports_lag_a_round_are_allotted_to_the_same_last_round() -> None:
    """ssgd, 48 each, a budget of 7,200 (75 rounds): the two workers' reports reach the scheduler a round apart in
    turn, so each would take the last samples at its own answer and one would train a 76th round alone; counting
    leads from the most advanced report and levelling the split in whole pushes ends both at round 75."""
    allocator = _fixed_pair(protocol="ssgd")
    for w0, w1 in (
        (0, 0),
        (3312, 3264),
        (3360, 3264),
        (3408, 3360),
        (3456, 3360),
        (3456, 3408),
        (3504, 3456),
        (3552, 3504),
        (3600, 3552),
        (3600, 3600),
    ):
        for worker in ("w0", "w1"):
            allocator.allot(worker, {"w0": w0, "w1": w1}, {"w0": w0 // 48, "w1": w1 // 48}, budget=7200)
            assert allocator.allotted[worker] <= 3600, (worker, w0, w1, allocator.allotted)
    assert allocator.allotted == {"w0": 3600, "w1": 3600} and allocator.unallotted == 0
    assert levelled(144, {"a": 3552, "b": 3504}, {"a": 48, "b": 48}) == {"a": 48, "b": 96}
    assert levelled(30, {"a": 0, "b": 0}, {"a": 48, "b": 0}) == {"a": 30, "b": 0}, "the last push cut to what is left"


@pytest.mark.parametrize("start", ["local", "asgd"])
def test_local_sgd_under_a_changing_split_ends_every_worker_at_the_same_round(start: str) -> None:
    """Local SGD (H = 4) with the three workers' batches 32 each, then the dynamic split moves them to 64, 21 and 11
    after 10 rounds: rounds count in the steps each worker reported, not in its samples over its push now, so
    all three train whole rounds to the budget's end together (the budget's remainder short of a push, cut, is one
    round of one worker's), whether local ran from the start or auto switched to it from asgd (where each had
    trained at its own pace). Counting samples over the push now, the 64 worker read its 32-sample rounds as half
    rounds and trained 11 rounds alone at the end, the 21 one 14 beyond the 11 one."""
    h, workers = 4, ("w0", "w1", "w2")
    allocator = _allocator(protocol=start, local_steps=h)
    samples, steps = {"w0": 4000, "w1": 2000, "w2": 1000}, {"w0": 100, "w1": 60, "w2": 40}
    if start == "local":
        samples, steps = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)
    else:
        allocator.switch(protocol_spec("local"), steps)
    budget = sum(samples.values()) + 30_000
    allocator.allocation = dict.fromkeys(workers, 32)
    rounds = dict.fromkeys(workers, 0)
    for rounds_run in itertools.count():
        if rounds_run == 10:
            allocator.allocation = {"w0": 64, "w1": 21, "w2": 11}
        pushes = {}
        for worker in workers:
            allocator.allot(worker, samples, steps, budget)
            pushes[worker] = allocator.batch_of(worker) * h
        if not any(pushes.values()):
            break
        for worker, push in pushes.items():
            samples[worker] += push
            steps[worker] += h if push else 0
            rounds[worker] += 1 if push else 0
    assert max(rounds.values()) - min(rounds.values()) <= 1, rounds
    assert 0 <= sum(samples.values()) - budget < h, "the budget, passed by fewer than one local round's steps"


def _answer(allocator: Allocator, worker: str, samples: dict[str, int], steps: dict[str, int], budget: int) -> int:
    """The scheduler's answer to `worker`'s report of `samples` and `steps`: its allotment and batch, handed to it."""
    allocator.allot(worker, samples, steps, budget)
    batch = allocator.batch_of(worker)
    allocator.hand(worker, batch)
    return batch


def test_a_worker_left_out_near_the_end_keeps_its_allotment_until_it_reports_that_it_holds_its_batch_0() -> None:
    """ssgd, 48 each, a budget of 1,440: the last of it is split between the two (720 each), then w1 is left out
    (batch 0) while a step of 48 it took under its last answer is on its way. What it did not use goes back to the
    job only once it reports holding its batch 0, so the step that lands counts against its own allotment, not
    against what w0 was given meanwhile: the job trains its 1,440 samples, not a batch more."""
    allocator = _fixed_pair(protocol="ssgd")
    samples, steps = {"w0": 624, "w1": 624}, {"w0": 13, "w1": 13}
    for worker in samples:
        _answer(allocator, worker, samples, steps, budget=1440)
    assert allocator.allotted == {"w0": 720, "w1": 720} and allocator.unallotted == 0
    stepping_under = allocator.assignment_id
    allocator.allocation = {"w0": 96, "w1": 0}  # the split leaves w1 out: a new assignment
    allocator.assignment_id += 1
    assert _answer(allocator, "w1", samples, steps, budget=1440) == 0
    assert allocator.allotted["w1"] == 720, "w1 may still be stepping under its last answer"
    samples["w1"], steps["w1"] = 672, 14  # the step it took under that answer lands
    allocator.stepped("w1", stepping_under)
    assert _answer(allocator, "w1", samples, steps, budget=1440) == 0 and allocator.allotted["w1"] == 720
    allocator.stepped("w1", allocator.assignment_id)  # it reports holding the answer that left it out
    while batch := _answer(allocator, "w0", samples, steps, budget=1440):
        samples["w0"] += batch
        steps["w0"] += 1
        allocator.stepped("w0", allocator.assignment_id)
    assert samples == {"w0": 768, "w1": 672} and allocator.allotted == samples, "the budget, no batch past it"


def test_after_a_switch_to_local_sgd_the_split_is_solved_on_the_transfers_a_round_pays() -> None:
    """Under asgd every step holds a pull and a push; local SGD pays them once a round of H steps. Two GPUs whose
    asgd step is mostly transfers beside two CPU workers that compute slowly, measured under asgd at equal batches:
    fitted on those steps, local's equal-step split would read the GPUs' transfers as their speed and give the CPU
    workers several times their share, so every round waits for them. After the switch the split is solved on each
    worker's compute and a round's transfers over its H steps, as from local SGD's own steps."""
    h, transfer = 8, {"g0": 0.3, "g1": 0.3, "c0": 0.02, "c1": 0.02}
    devices = {"g0": (0.04, 0.00026), "g1": (0.04, 0.00026), "c0": (0.005, 0.01), "c1": (0.005, 0.01)}
    allocator = _allocator(global_batch=512, batch_policy="dynamic", local_steps=h)
    for wid, (fixed, per_sample) in devices.items():
        allocator.measure(wid, 128 / (fixed + per_sample * 128), instance="", fixed_s=fixed)
    samples = {}
    for wid, (fixed, per_sample) in devices.items():
        compute = fixed + per_sample * 128
        for step in range(1, 9):
            hb = WorkerHeartbeat(
                steps=step, samples=128 * step, batch=128, times=StepTimes(compute + transfer[wid], compute)
            )
            allocator.observe(wid, hb)
        samples[wid] = 128 * 8
    allocator.switch(protocol_spec("local"), {wid: 8 for wid in samples})
    allocator.reallocate(0.0, 0.0, "protocol local", "auto", {wid: 0 for wid in devices}, force=True)
    local = {w: StepModel(f + transfer[w] / h, c) for w, (f, c) in devices.items()}
    expected = allocate(local, 512, 1, 512)
    assert all(abs(allocator.allocation[w] - b) <= 1 for w, b in expected.items()), (allocator.allocation, expected)
    assert expected["c0"] < 20 and allocator.speeds["c0"].observations == 0, "measured anew under local SGD"
