"""`--batch-policy auto` (scheduler/auto_policy.py): the policy it chooses on each regime's cluster file, and the
allocator's split under it as workers report steps, join, leave and change speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.planning.auto_choice import EARLY_MARGINS, HYSTERESIS, choose, early_hysteresis
from dynabatch.common.planning.cluster_file import read_cluster
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import cluster_of, fixed_batches
from dynabatch.common.planning.protocol_switch import START, SWITCHABLE
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.allocator import Allocator
from dynabatch.scheduler.auto_policy import (
    EARLY_STEPS,
    MEASURED_STEPS,
    SHIFT,
    AutoPolicy,
    folded_cluster,
    measured_workers,
)
from dynabatch.scheduler.batch_allocation import allocate_round, fixed_allocation
from dynabatch.scheduler.speed_model import StepModel

PROFILES = Path(__file__).resolve().parents[1] / "bench" / "profiles"
CHUNK_BYTES = 1 << 20

# The policy the regime study (bench/RESULTS.md section 14) found faster for each modelled protocol on each cluster
# file: per-worker sizing wins for ssgd's rounds on mixed devices (LB-BSP 1.48x faster on mixed_gpus16; on
# cpu_gpu8 76% against 70% at the budget) and loses for asgd (DBS-SGD 1.12x slower on mixed_gpus16, never at 80%
# on cpu_gpu8, and behind at the budget on mixed_links16). On ps_bound64 the shard bounds every method alike, so
# auto keeps fixed. On mixed_links16 the study's rounds all waited for the 10 Mbit workers' first transfers, before
# any was measured (12.3% under either policy); once they are measured, LB-BSP's round leaves them out (batch 0).
STUDY_CHOICE = {
    ("mixed_gpus16", "ssgd"): "dynamic",
    ("mixed_gpus16", "asgd"): "fixed",
    ("cpu_gpu8", "ssgd"): "dynamic",
    ("cpu_gpu8", "asgd"): "fixed",
    ("mixed_links16", "ssgd"): "dynamic",
    ("mixed_links16", "asgd"): "fixed",
    ("ps_bound64", "ssgd"): "fixed",
    ("ps_bound64", "asgd"): "fixed",
}


def _as_measured(path: Path) -> tuple[dict[str, StepModel], dict[str, int], int]:
    """A cluster file's workers as the scheduler measures them under the fixed split auto starts with: each
    worker's step as the predictor runs it (compute and transfers pipelined, stretched where the shards bound the
    steps), its compute (the device's fixed part included: a batch that never varies cannot separate it) per
    sample, the rest fixed (SpeedModel.overhead_fit's reading); their caps; the file's B."""
    cluster = cluster_of(read_cluster(path), 0, CHUNK_BYTES)
    batches = fixed_batches(cluster)
    steps = [cluster.step_s(n, b) for n, b in zip(cluster.nodes, batches, strict=True)]
    slowed = min(1.0, cluster.max_steps_per_s() / sum(1 / s for s in steps))
    models, caps = {}, {}
    for i, (node, batch, step) in enumerate(zip(cluster.nodes, batches, steps, strict=True)):
        compute = node.device.seconds(batch)
        models[f"w{i:02d}"] = StepModel(step / slowed - compute, compute / batch)
        caps[f"w{i:02d}"] = node.device.max_batch
    return models, caps, cluster.global_batch


@pytest.mark.parametrize(("profile", "protocol"), sorted(STUDY_CHOICE))
def test_auto_chooses_the_studys_policy_on_each_regimes_cluster_file(profile: str, protocol: str) -> None:
    models, caps, global_batch = _as_measured(PROFILES / f"{profile}.json")
    auto = AutoPolicy(protocol_spec(protocol), global_batch)
    changed = auto.revisit(models, caps, waiting=0)
    assert auto.policy == STUDY_CHOICE[profile, protocol], auto.reason
    assert changed == (auto.policy != "fixed"), "auto ran fixed while it measured"
    expected = choose(folded_cluster(models, caps, global_batch), STUDY_NOISE, (protocol, "fixed"), (protocol,))
    assert auto.reason.startswith(expected.reason), auto.reason
    assert (
        f"{protocol} + " in auto.reason and "T*" in auto.reason and f"(measured workers: {len(models)})" in auto.reason
    )


def test_a_worker_is_measured_after_its_steps_or_once_they_lasted_as_long_as_the_others_took() -> None:
    """A worker behind a slow link whose one step outlasts the others' MEASURED_STEPS counts as measured: it would
    otherwise hold the choice for MEASURED_STEPS of its own long steps. No worker with a step reported: none."""
    steps = MEASURED_STEPS
    fast, slow = (steps, 0.5), (steps, 0.6)
    assert measured_workers({"a": fast, "b": slow, "c": (1, 60.0), "d": (0, 60.0)}, steps) == ["a", "b", "c"]
    assert measured_workers({"a": fast, "b": slow, "c": (1, 4.0)}, steps) == ["a", "b"], "4 s < 8 x 0.6 s"
    assert measured_workers({"a": fast, "b": slow, "c": (6, 0.8)}, steps) == ["a", "b", "c"], "6 x 0.8 s >= 4.8 s"
    assert measured_workers({"a": (steps - 1, 0.5), "c": (1, 60.0)}, steps) == [], "nobody has its steps yet"


def test_a_protocol_the_predictor_does_not_model_runs_fixed_and_says_why() -> None:
    auto = AutoPolicy(protocol_spec("msd"), 96)
    assert not auto.revisit({"w0": StepModel(0.0, 0.001), "w1": StepModel(0.1, 0.01)}, {}, waiting=0)
    assert auto.policy == "fixed" and "msd is not modelled" in auto.reason and "asgd" in auto.reason


@pytest.mark.parametrize("aggregation", ["median", "trimmed-mean"])
def test_a_robust_aggregation_keeps_every_worker_in_each_round_so_auto_runs_fixed(aggregation: str) -> None:
    """ssgd with a worker four times slower, which LB-BSP would size down (or leave out): under a robust
    aggregation auto keeps the fixed split and says why, once every worker is measured too."""
    allocator = _allocator(protocol="ssgd", aggregation=aggregation)
    ready = _join(allocator, ["w0", "w1", "w2"])
    for wid, per_sample_s in (("w0", 0.001), ("w1", 0.001), ("w2", 0.004)):
        _step(allocator, ready, wid, per_sample_s, MEASURED_STEPS + 1)
    assert allocator.auto is not None and allocator.auto.policy == "fixed"
    assert f"--aggregation {aggregation} needs every worker's gradient" in allocator.auto.reason
    assert allocator.allocation == {"w0": 32, "w1": 32, "w2": 32}
    mean = _allocator(protocol="ssgd", aggregation="mean")
    ready = _join(mean, ["w0", "w1", "w2"])
    for wid, per_sample_s in (("w0", 0.001), ("w1", 0.001), ("w2", 0.004)):
        _step(mean, ready, wid, per_sample_s, MEASURED_STEPS + 1)
    assert mean.auto is not None and mean.auto.policy == "dynamic", "the same cluster under the mean: LB-BSP"


def _allocator(**kw: Any) -> Allocator:
    job = JobConfig(**{"dataset": "synthetic", "global_batch": 96, "protocol": "asgd", "batch_policy": "auto", **kw})
    return Allocator(job, protocol_spec(job.protocol))


def _join(allocator: Allocator, workers: list[str]) -> dict[str, int]:
    for wid in workers:
        allocator.measure(wid, 1000.0, instance="")
    ready = {wid: 0 for wid in workers}
    allocator.reallocate(0.0, 0.0, "joined", workers[-1], ready, force=True)
    return ready


def _step(allocator: Allocator, ready: dict[str, int], wid: str, per_sample_s: float, steps: int = 1) -> None:
    """`wid` reports `steps` steps at the batch it holds, 5 ms of each spent outside compute."""
    for _ in range(steps):
        batch = allocator.allocation[wid] or 1
        compute = per_sample_s * batch
        allocator.observe(wid, WorkerHeartbeat(batch=batch, times=StepTimes(step_s=0.005 + compute, compute_s=compute)))
        allocator.reallocate(1.0, 1.0, "speed update", wid, ready)


def test_auto_splits_as_fixed_until_every_worker_is_measured_then_by_the_chosen_policy() -> None:
    """ssgd, a worker ten times slower: fixed while its steps have not yet lasted as long as the others' first
    MEASURED_STEPS (`measured_workers`), then LB-BSP's split. Its one step lasts longer than the others' eight, so
    the span rule measures it on that step, where the early rule (EARLY_MARGINS) could have chosen on it too: the
    choice is a measured one."""
    allocator = _allocator(protocol="ssgd")
    ready = _join(allocator, ["w0", "w1", "w2"])
    assert allocator.allocation == {"w0": 32, "w1": 32, "w2": 32}
    _step(allocator, ready, "w0", 0.001, MEASURED_STEPS)
    _step(allocator, ready, "w1", 0.001, MEASURED_STEPS)
    slow, fast = 0.005 + 0.01 * 32, 0.005 + 0.001 * 32  # _step's step seconds at batch 32
    assert slow >= MEASURED_STEPS * fast and EARLY_STEPS == 1
    assert allocator.auto is not None and allocator.auto.policy == "fixed"
    assert "2 of 3 measured" in allocator.auto.reason
    assert allocator.allocation == {"w0": 32, "w1": 32, "w2": 32}
    _step(allocator, ready, "w2", 0.01)
    assert allocator.auto.policy == "dynamic", allocator.auto.reason
    assert allocator.auto.reason.startswith("ssgd + dynamic: predicted fastest"), allocator.auto.reason
    assert allocator.auto.reason.endswith("(measured workers: 3)"), allocator.auto.reason
    assert "auto chose dynamic" in allocator.decisions[-1].reason
    models = {w: allocator.speeds[w].fit() for w in ready}
    fitted = {w: m for w, m in models.items() if m is not None}
    assert len(fitted) == len(models), models
    assert allocator.allocation == allocate_round(fitted, 96, 8, 1024, {}), "the split is the chosen policy's"
    assert allocator.allocation["w2"] < allocator.allocation["w0"]


def test_equal_workers_keep_the_fixed_split_and_noise_is_no_reason_to_choose_again() -> None:
    for protocol in ("asgd", "ssgd"):
        allocator = _allocator(protocol=protocol)
        ready = _join(allocator, ["w0", "w1", "w2"])
        for wid in ready:
            _step(allocator, ready, wid, 0.001, MEASURED_STEPS)
        auto = allocator.auto
        assert auto is not None and auto.policy == "fixed" and auto.choices == 1
        kept = (f"{protocol} + fixed: kept, predicted", f"{protocol} + fixed: predicted fastest")
        assert auto.reason.startswith(kept), auto.reason
        assert allocator.allocation == fixed_allocation(sorted(ready), 96, 8, 1024)
        _step(allocator, ready, "w1", 0.001 * (1 + SHIFT / 2))
        assert auto.choices == 1, "a step within SHIFT of the last choice's is not a speed shift"


def test_a_speed_shift_a_join_and_a_leave_make_auto_choose_again() -> None:
    """ssgd: three equal workers (fixed), one slows down fourfold (dynamic), it leaves (the two left are equal:
    dynamic is kept, the two given the same batch), a fast one joins (chosen again)."""
    allocator = _allocator(protocol="ssgd")
    ready = _join(allocator, ["w0", "w1", "w2"])
    for wid in ready:
        _step(allocator, ready, wid, 0.001, MEASURED_STEPS)
    auto = allocator.auto
    assert auto is not None and auto.policy == "fixed"
    for _ in range(8):  # the forgetting window follows the shift within a few steps
        _step(allocator, ready, "w2", 0.004)
        if auto.policy == "dynamic":
            break
    assert auto.policy == "dynamic" and auto.choices == 2, auto.reason
    allocator.forget("w2")
    del ready["w2"]
    allocator.reallocate(2.0, 2.0, "left", "w2", ready, force=True)
    assert auto.choices == 3 and allocator.allocation == {"w0": 48, "w1": 48}, auto.reason
    chosen = auto.reason
    allocator.measure("w3", 1000.0, instance="")
    ready["w3"] = 0
    allocator.reallocate(3.0, 3.0, "joined", "w3", ready, force=True)
    assert auto.choices == 3 and "2 of 3 measured" in auto.reason, "a worker that joined is measured first"
    assert auto.reason.startswith(chosen), "the choice it holds meanwhile, and why: no new choice on the console"
    assert auto.reason.endswith("; chosen again once every worker has reported 8 steps (2 of 3 measured)"), (
        "said as a choice that stands and is made again, not as one held back"
    )
    _step(allocator, ready, "w3", 0.001, MEASURED_STEPS)
    assert auto.choices == 4 and "(measured workers: 3)" in auto.reason


def test_auto_chooses_no_more_once_the_whole_budget_is_allotted() -> None:
    """ssgd with a worker four times slower, which LB-BSP would size down: with every sample of the job allotted,
    the job ends under the split it runs, and auto never chooses (the workers that trained their share leave the
    measured set; a choice over the rest would switch for nothing)."""
    allocator = _allocator(protocol="ssgd")
    ready = _join(allocator, ["w0", "w1", "w2"])
    allocator.allot("w0", {"w0": 0, "w1": 0, "w2": 0}, {"w0": 0, "w1": 0, "w2": 0}, budget=96)
    assert allocator.unallotted == 0
    for wid, per_sample_s in (("w0", 0.001), ("w1", 0.001), ("w2", 0.004)):
        _step(allocator, ready, wid, per_sample_s, MEASURED_STEPS + 1)
    assert allocator.auto is not None and allocator.auto.choices == 0 and allocator.auto.policy == "fixed"
    assert allocator.allocation == {"w0": 32, "w1": 32, "w2": 32}


def _long_steps(allocator: Allocator, ready: dict[str, int], steps: int, transfer_s: float) -> None:
    """Every worker of `ready` reports `steps` steps at its batch: 0.1 s fixed and 1 ms a sample of compute, and
    `transfer_s` of pulling and pushing."""
    for _ in range(steps):
        for wid in ready:
            batch = allocator.allocation[wid]
            compute = 0.1 + 0.001 * batch
            allocator.observe(wid, WorkerHeartbeat(batch=batch, times=StepTimes(compute + transfer_s, compute)))
            allocator.reallocate(1.0, 1.0, "speed update", wid, ready)


def test_the_margin_of_an_early_choice_narrows_as_the_workers_fewest_steps_grow() -> None:
    """The tiered rule (common/planning/auto_choice.py): three times faster on the probes and the shards before any
    step, and on one step (its start-up and its wait behind the others' first pulls in it), 1.5x from the second, and
    every early margin wider than a measured choice's."""
    with pytest.raises(ValueError):
        early_hysteresis(-1)
    assert [early_hysteresis(n) for n in range(MEASURED_STEPS)] == [2.0, 2.0] + [0.5] * (MEASURED_STEPS - 2)
    assert EARLY_MARGINS[0][0] == 0 and EARLY_STEPS == EARLY_MARGINS[1][0] == 1, "the probes' tier, then the steps'"
    margins = [m for _, m in EARLY_MARGINS]
    assert margins == sorted(margins, reverse=True) and min(margins) > HYSTERESIS


@pytest.mark.parametrize(("transfer_s", "chosen_on"), [(10.0, 1), (0.3, 2), (0.01, None)])
def test_where_the_margin_is_wide_auto_chooses_on_every_workers_first_steps(
    transfer_s: float, chosen_on: int | None
) -> None:
    """A shard-bound job: each asgd step is 0.2 s of compute and 10 s of transfers, so a worker's eighth step comes
    after 80 s. Local SGD (a round's transfers over its H steps) is predicted more than three times faster than asgd
    on every worker's first step, and auto switches then, saying how many are measured; it chooses again once every
    worker is measured. With 0.3 s of transfers the margin is under three times and over 1.5x: auto waits for the
    second step. Where the transfers are short nothing wins by either margin, and auto waits for MEASURED_STEPS as
    before."""
    job = JobConfig(dataset="synthetic", global_batch=512, protocol="auto", batch_policy="auto")
    allocator = Allocator(job, protocol_spec(START), SWITCHABLE)
    ready = _join(allocator, [f"w{i}" for i in range(8)])
    auto = allocator.auto
    assert auto is not None
    for steps in range(1, (chosen_on or EARLY_MARGINS[-1][0]) + 1):
        assert auto.protocol == START and auto.choices == 0, (steps, auto.reason)
        _long_steps(allocator, ready, 1, transfer_s)
    if chosen_on is None:
        assert auto.protocol == START and auto.choices == 0 and "0 of 8 measured" in auto.reason, auto.reason
        _long_steps(allocator, ready, MEASURED_STEPS - EARLY_MARGINS[-1][0], transfer_s)
        assert auto.choices == 1 and "(measured workers: 8)" in auto.reason, auto.reason
        return
    assert auto.protocol == "local" and auto.choices == 1, auto.reason
    said = "first step" if chosen_on == 1 else f"first {chosen_on} steps"
    assert f"{said} or more, 0 of 8 measured" in auto.reason, auto.reason
    allocator.switch(protocol_spec("local"), {w: 0 for w in ready})
    _long_steps(allocator, ready, MEASURED_STEPS, transfer_s / job.local_steps)
    assert auto.choices == 2 and auto.protocol == "local", "chosen again on every worker measured under local SGD"
    assert "(measured workers: 8)" in auto.reason, auto.reason


@pytest.mark.parametrize(
    ("service_s", "first_push_s", "chosen"),
    [(0.5, [2.0] * 8, True), (0.5, [2.0] * 4 + [80.0] * 4, False), (1e-4, [0.1] * 8, False)],
)
def test_before_any_step_auto_chooses_the_protocol_on_the_probes_first_pushes_and_the_shards_own_count(
    service_s: float, first_push_s: list[float], chosen: bool
) -> None:
    """Eight workers whose probes say 1 ms a sample, none has reported a step. Auto holds until a shard has
    reported what it served and every worker's first push. A shard that served ten transfers in half a second each
    bounds asgd (two transfers a step, eight workers: 8 s a round of steps against 64 ms of compute); with every
    first push 2 s after the batch, local SGD is predicted more than three times faster, and auto switches before
    the first step and says what it chose on. Where four first pushes took 80 s (slow links, which local SGD's
    rounds would wait for) it keeps asgd, as it does where the shard serves a transfer in 0.1 ms and bounds
    nothing."""
    job = JobConfig(dataset="synthetic", global_batch=512, protocol="auto", batch_policy="auto")
    allocator = Allocator(job, protocol_spec(START), SWITCHABLE)
    ready = _join(allocator, [f"w{i}" for i in range(8)])
    auto = allocator.auto
    assert auto is not None and allocator.choosing_on_probes()
    allocator.tally.shard_reported(0, 10 * service_s, 0.0, 10.0)
    for wid, seconds in list(zip(ready, first_push_s, strict=True))[:-1]:
        allocator.tally.pushed(wid, seconds, allocator.allocation[wid])
    allocator.reallocate(0.5, 0.5, "shard load", "ps0", ready)
    assert auto.protocol == START and auto.choices == 0 and "0 of 8 measured" in auto.reason, "a first push missing"
    allocator.tally.pushed("w7", first_push_s[-1], 64)
    allocator.tally.pushed("w7", 0.01, 64)
    assert allocator.tally.first_push["w7"] == (first_push_s[-1], 64), "the first report is the first push"
    allocator.reallocate(0.5, 0.5, "shard load", "ps0", ready)
    if not chosen:
        assert auto.protocol == START and auto.choices == 0 and allocator.choosing_on_probes(), auto.reason
        return
    assert auto.protocol == "local" and auto.choices == 1 and not allocator.choosing_on_probes(), auto.reason
    said = "(chosen on every worker's start-up probe and first push, and the shards' service time, 0 of 8 measured)"
    assert said in auto.reason, auto.reason
    allocator.switch(protocol_spec("local"), {w: 0 for w in ready})
    _long_steps(allocator, ready, 1, 2 * service_s / job.local_steps)
    assert auto.protocol == "local", "the workers' own first steps under local SGD keep it"
    allocator.forget("w0")
    assert "w0" not in allocator.tally.first_push


def test_the_first_tier_is_protocol_autos_a_named_protocol_with_auto_batches_waits_for_the_steps() -> None:
    """`--protocol ssgd --batch-policy auto`: the shards and every first push say what the first tier needs, but
    the protocol cannot switch, so auto keeps fixed batches until the workers' steps (the first tier is there for a
    shard that bounds asgd's steps, which only the protocol relieves)."""
    job = JobConfig(dataset="synthetic", global_batch=512, protocol="ssgd", batch_policy="auto")
    allocator = Allocator(job, protocol_spec("ssgd"))
    ready = _join(allocator, [f"w{i}" for i in range(8)])
    assert not allocator.choosing_on_probes()
    allocator.tally.shard_reported(0, 5.0, 0.0, 10.0)
    for wid in ready:
        allocator.tally.pushed(wid, 2.0, allocator.allocation[wid])
    allocator.reallocate(0.5, 0.5, "shard load", "ps0", ready)
    assert allocator.auto is not None and allocator.auto.choices == 0 and allocator.auto.policy == "fixed"
