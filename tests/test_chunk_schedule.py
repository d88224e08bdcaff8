"""The wire's schedule driven directly: the plan rule (scheduler/chunk_schedule.py), its hysteresis over a
worker's heartbeats (scheduler/wire_schedule.py), the serving ranks (scheduler/serving_priority.py) and the
order a shard serves one poll's messages in (ps/serve_order.py)."""

from __future__ import annotations

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.net.transport import Incoming
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.frames import ChunkMeta, Message
from dynabatch.common.wire.messages import Pull, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.ps.serve_order import serve_key
from dynabatch.scheduler.chunk_schedule import STABLE_PROPOSALS, StepSample, WirePlan, plan_for, settle
from dynabatch.scheduler.serving_priority import WorkerTimes, serving_ranks
from dynabatch.scheduler.wire_schedule import WireSchedule

MB = 1_000_000
MODEL_BYTES = 40 * MB  # a step pulls the model and pushes its gradient: twice this
CHUNK = 64 << 10
GBIT, MBIT100 = 125 * MB, 12.5 * MB  # bytes/s
LEAST_CREDIT = 1 << 20  # the job's --max-inflight-bytes


def _step(rate: float, compute_s: float = 0.3) -> StepSample:
    """One step of a worker on a link of `rate` bytes/s whose compute hides none of the transfer."""
    return StepSample(compute_s, 2 * MODEL_BYTES / rate, 2 * MODEL_BYTES)


def test_a_slower_link_gets_smaller_pushes_and_less_in_flight_never_below_the_jobs_credit() -> None:
    fast, slow = plan_for(_step(GBIT), CHUNK, 0, LEAST_CREDIT), plan_for(_step(MBIT100), CHUNK, 0, LEAST_CREDIT)
    assert fast.group > slow.group >= 1 and fast.credit > slow.credit >= 2 * slow.group * CHUNK, (fast, slow)
    assert "Mbit/s" in fast.reason
    slowest = plan_for(_step(MBIT100 / 100), CHUNK, 0, LEAST_CREDIT)
    assert slowest.group == 1 and slowest.credit == LEAST_CREDIT


def test_a_plan_is_powers_of_two_within_the_push_and_the_layout() -> None:
    plan = plan_for(StepSample(10.0, 0.01, 2 * MODEL_BYTES), CHUNK, 4, LEAST_CREDIT)  # a very fast link, long compute
    assert plan.group == 4, "no more chunks per push than the layout has"
    assert plan.credit <= MODEL_BYTES and plan.credit & (plan.credit - 1) == 0
    assert plan_for(StepSample(0.1, 0.0, 0), CHUNK, 0, LEAST_CREDIT) == WirePlan(
        1, LEAST_CREDIT, "no transfer measured yet"
    )


def test_one_odd_step_changes_nothing_and_a_lasting_change_is_followed() -> None:
    current = plan_for(_step(GBIT), CHUNK, 0, LEAST_CREDIT)
    odd = plan_for(_step(MBIT100), CHUNK, 0, LEAST_CREDIT)
    assert settle(current, [current, current, odd]) is None
    assert settle(current, [odd] * (STABLE_PROPOSALS - 1)) is None
    assert settle(current, [odd] * STABLE_PROPOSALS) == odd
    assert settle(None, [odd]) == odd, "a worker's first plan is taken at once"


def _heartbeats(rates: list[float], compute_s: float = 0.3) -> list[WorkerHeartbeat]:
    """A worker's heartbeats after each step on links of `rates` (cumulative counters, as a worker sends them)."""
    beats, moved = [], 0
    for steps, rate in enumerate(rates, 1):
        moved += 2 * MODEL_BYTES
        transfer = 2 * MODEL_BYTES / rate
        beats.append(
            WorkerHeartbeat(
                steps=steps,
                samples=32 * steps,
                batch=32,
                times=StepTimes(
                    step_s=compute_s + transfer, compute_s=compute_s, pull_s=transfer / 2, push_s=transfer / 2
                ),
                bytes=moved,
            )
        )
    return beats


def _plans(schedule: WireSchedule, beats: list[WorkerHeartbeat]) -> list[WirePlan]:
    """The plan handed out after each heartbeat."""
    plans, prev = [], WorkerHeartbeat()
    for hb in beats:
        schedule.observe("w0", prev, hb)
        plans.append(schedule.plan_of("w0"))
        prev = hb
    return plans


def _schedule(mode: str, protocol: str = "asgd") -> WireSchedule:
    job = JobConfig(
        dataset="synthetic", chunk_bytes=CHUNK, chunk_schedule=mode, protocol=protocol, max_inflight_bytes=LEAST_CREDIT
    )
    return WireSchedule(job, protocol_spec(job.protocol))


def test_the_plan_follows_a_link_that_slows_down_and_recovers_when_it_heals() -> None:
    """1 Gbit for 6 steps, 100 Mbit for 6, 1 Gbit again: the plan follows each lasting change after
    STABLE_PROPOSALS steps, and comes back to the first one."""
    plans = _plans(_schedule("scheduled"), _heartbeats([GBIT] * 6 + [MBIT100] * 6 + [GBIT] * 6))
    healthy, slowed, healed = plans[5], plans[11], plans[17]
    assert slowed.group < healthy.group and slowed.credit < healthy.credit, plans
    assert healed.same(healthy), (healthy, healed)
    assert plans[6 + STABLE_PROPOSALS - 2].same(healthy), "followed before the change had lasted"
    assert plans[6 + STABLE_PROPOSALS - 1].same(slowed)
    assert len({(p.group, p.credit) for p in plans}) == 2, "no plan between the two links"


def test_fixed_hands_out_the_jobs_own_flags_whatever_the_link() -> None:
    schedule = _schedule("fixed")
    plans = _plans(schedule, _heartbeats([GBIT] * 3 + [MBIT100] * 3))
    job = schedule.job
    assert {(p.group, p.credit) for p in plans} == {(1, job.max_inflight_bytes)}
    assert schedule.ranks(["w0"]) == {}


def test_a_round_serves_its_slowest_worker_first_and_asynchronous_the_most_transfer_bound() -> None:
    times = {
        "w0": WorkerTimes(own_s=1.0, transfer_s=0.1),
        "w1": WorkerTimes(own_s=0.5, transfer_s=0.4),
        "w2": WorkerTimes(own_s=2.0, transfer_s=0.5),
    }
    assert serving_ranks(times, rounds=True) == {"w2": 0, "w0": 1, "w1": 2}
    assert serving_ranks(times, rounds=False) == {"w1": 0, "w2": 1, "w0": 2}
    tied = {"w1": WorkerTimes(1.0, 0.5), "w0": WorkerTimes(1.0, 0.5)}
    assert serving_ranks(tied, rounds=True) == {"w0": 0, "w1": 1}, "ties by id, alike on every shard"


@pytest.mark.parametrize(("protocol", "first"), [("ssgd", "slow"), ("asgd", "wired")])
def test_the_schedule_ranks_the_workers_its_protocol_waits_on_first(protocol: str, first: str) -> None:
    """ssgd closes rounds (the slowest own step first); asgd does not (the most transfer-bound first)."""
    schedule = _schedule("scheduled", protocol)
    schedule.observe(
        "slow",
        WorkerHeartbeat(),
        WorkerHeartbeat(steps=1, batch=8, times=StepTimes(step_s=2.0, compute_s=1.8, pull_s=0.1, push_s=0.1), bytes=MB),
    )
    schedule.observe(
        "wired",
        WorkerHeartbeat(),
        WorkerHeartbeat(steps=1, batch=8, times=StepTimes(step_s=1.0, compute_s=0.2, pull_s=0.4, push_s=0.4), bytes=MB),
    )
    assert schedule.ranks(["slow", "wired"])[first] == 0
    schedule.forget(first)
    assert first not in schedule.ranks(["slow", "wired"])


def _pull_from(sender: str, ids: list[int]) -> Incoming:
    return Incoming(b"c", Message(Pull(ids=ids), [], [], "dynabatch", sender, 1), None)


def test_a_shard_orders_one_polls_messages_by_rank_then_front_of_the_model() -> None:
    ranks = {"w1": 0, "w0": 1}
    waiting = [
        _pull_from("w0", [0]),
        _pull_from("w2", [0]),
        _pull_from("w1", [5]),
        _pull_from("w1", [2]),
        Incoming(b"c", None, None),
    ]
    order = sorted(waiting, key=lambda i: serve_key(i, ranks))
    assert [(i.message.sender, i.message.body.ids) if i.message else None for i in order] == [
        None,
        ("w1", [2]),
        ("w1", [5]),
        ("w0", [0]),
        ("w2", [0]),
    ]
    chunked = Incoming(b"c", Message(Pull(), [ChunkMeta(7, "float32", (1,), 0)], [], "dynabatch", "w0", 1), None)
    assert serve_key(chunked, {}) == (0, 7), "unranked: every worker alike, front of the model first"
