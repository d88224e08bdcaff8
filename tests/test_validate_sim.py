"""The simulator against a small real run of the same shape (bench/validate_sim.py): each worker's own fixed and
per-sample cost (`--slowdowns F:A`), its memory cap (`--max-batches`) and the dynamic split they lead to.

The real run measures what the simulator is given (this machine's curve, each worker's contention k, each worker's
time outside its compute); what it must then predict is the batches the scheduler hands out, the staleness and the
samples per second, each within the criterion's 10% and as much as the real run's own pace drifted between its
halves (a machine shared with other jobs changes its load under a run, and the simulator is given the run's
averages). Each worker has its own k: on a loaded machine a worker that sleeps more (waits for a round, idles its
emulated slowdown) meets less contention when it wakes, so the workers' figures differ by a third and more, and one k
for all (the lowest, say) simulates a cluster that did not run.

Each feature of the simulator has its shape: caps and fixed costs under asgd's dynamic split; LB-BSP (ssgd +
dynamic) with a worker capped below its share, where a round is the slowest of several noisy steps and the shard's
close (the simulated shard serves at the real one's measured service time, each worker's steps vary as its real
ones did); a busy shard's queue. The efficient policy's whole split is not among them: it follows each worker's
start-up probe of its fixed part, which under load read 7 ms of an emulated 20 (bench/RESULTS.md 36); given the
probes' readings the simulated split moved toward the real one, not yet within 10%."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from bench.simulate import SimResult
from bench.validate_sim import (
    TOLERANCE,
    Observed,
    Shape,
    ShardSeen,
    batch_slack,
    compare,
    contention,
    contentions,
    device_times,
    machine_curve,
    observed_rate,
    observed_shard,
    pace_drift,
    real_run,
    service_spread,
    simulated,
)
from dynabatch.cluster.report import read_timeline
from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import JobStatus, ShardStatus, WorkerStatus

pytestmark = pytest.mark.slow

# A fixed part of 50 ms keeps worker 0 at the least batch, a cap of 24 holds worker 1, worker 2 takes the rest. The
# fixed part is a sleep, which the load does not stretch, and the compute is k times this machine's: at 20 ms worker 0
# left the least batch once k passed about 1.4, and under two suites (k 3 to 11) its batch was a split between two
# near-equal devices that turned on the moment of the scheduler's last re-split (bench/RESULTS.md 67). At 50 ms it
# stays at the least batch until k passes about 23.
SHAPE = Shape(("1:0.05", "2", "4:0.01"), (0, 24, 0), "asgd", "dynamic", global_batch=96, budget_s=8.0)


def test_contention_is_what_the_compute_phase_held_beyond_the_emulated_device() -> None:
    curve = (0.001, 0.0001)  # 1 ms + 0.1 ms a sample: 3.4 ms of CPU at 24 samples
    cpu = 0.001 + 0.0001 * 24
    seen = Observed(steps=10, batch=24.0, step_s=0.1, compute_s=1.5 * cpu + 3 * cpu + 0.01)
    assert contention("4:0.01", seen, curve) == pytest.approx(1.5), "wall 1.5 x CPU, plus 3 x CPU and 10 ms idled"
    assert contention("1", Observed(1, 24.0, 0.1, cpu), curve) == pytest.approx(1.0), "a quiet machine"


def _one_worker(batch: float) -> SimResult:
    """A simulation of one worker at 100 samples/s and a staleness of 1 whose ten steps had this mean batch."""
    samples = round(10 * batch)
    return SimResult(
        "asgd", "dynamic", 0, 1, {}, 0.0, None, 100.0, 0.0, [], 1.0, None, samples, [], {},
        worker_steps={"sim0": 10}, worker_samples={"sim0": samples},
    )  # fmt: skip


def _batch_within(
    real: float, simulated: float, slack: float, even_share: float = 0.0, halves: tuple[float, ...] = ()
) -> bool | None:
    """Whether one worker's mean batch, `real` in the real run and `simulated` over ten simulated steps (and
    `halves` in the simulations given each half of the run), is judged within the criterion (`compare`, at
    TOLERANCE, the policy's hysteresis `slack` and `even_share`)."""
    seen = [Observed(steps=10, batch=real, step_s=0.1, compute_s=0.05)]
    real_figures = {"observed_samples_per_s": 100.0, "staleness_mean": 1.0}
    bracket = [_one_worker(b) for b in halves]
    rows = compare(real_figures, _one_worker(simulated), seen, TOLERANCE, slack, even_share, bracket)
    return next(ok for name, _, _, ok in rows if "batch" in name)


def test_a_batch_is_judged_within_the_policys_hysteresis_more_and_nothing_more_under_fixed_batches() -> None:
    assert batch_slack(SHAPE) == JobConfig().reassign_threshold > 0, "dynamic keeps a batch within the threshold"
    assert batch_slack(replace(SHAPE, policy="fixed")) == 0.0
    within = [_batch_within(20.0, 23.0, slack) for slack in (0, 0.1)]
    assert within == [False, True], "23 against 20 is 15%: beyond 10%, within 10% + 10%"


def test_a_batch_held_near_the_least_is_judged_on_the_even_share_not_on_itself() -> None:
    """Two runs that hold worker 0 at or a few samples above the least batch, 8 of an even 32, split B alike; one
    that gives it 20 does not."""
    assert SHAPE.even_share == 32
    assert _batch_within(8.15, 11.9, 0.1, 32) and _batch_within(11.8, 8.7, 0.1, 32), "within 20% of 32: 6.4 samples"
    assert not _batch_within(8.0, 20.0, 0.1, 32), "12 samples more is another split"
    assert _batch_within(60.0, 71.0, 0.1, 32), "a large batch is judged on itself: 20% of 60"
    assert not _batch_within(60.0, 73.0, 0.1, 32)
    assert not _batch_within(8.15, 11.9, 0.1), "judged on itself, 8.15 against 11.9 is 46%"


def test_the_benchs_second_verdict_judges_a_figure_against_the_range_the_halves_of_the_run_simulate() -> None:
    """A loaded run of SHAPE at a fixed part of 20 ms: worker 0's batch 38.2 real, 30.2 simulated from the whole
    run's measurements, 25.6 and 33.7 from each half's, as the load moved under it (bench/RESULTS.md 67). The bench
    prints this verdict beside the criterion's to say whether a miss is the load's moving under the run."""
    assert not _batch_within(38.2, 30.2, 0.1, 32), "beyond 20% of 38.2 from the whole run's figure alone"
    assert _batch_within(38.2, 30.2, 0.1, 32, (25.6, 33.7)), "within 20% of the range the halves span"
    assert _batch_within(38.2, 30.2, 0.1, 32, (33.7, 25.6)), "in either order"
    assert not _batch_within(38.2, 30.2, 0.1, 32, (29.0, 30.5)), "halves that agree with the whole run"
    assert _batch_within(80.0, 60.2, 0.1, 32, (45.4, 67.0)), "within 20% of 80 of the range's top"
    assert not _batch_within(90.0, 60.2, 0.1, 32, (45.4, 67.0))


@dataclass(frozen=True)
class Validated:
    """A real run of a shape beside the simulator given its measurements, each worker at its own contention
    figure (`ks`)."""

    real: dict[str, Any]
    seen: list[Observed]
    shard: ShardSeen
    drift: float  # how far the real run's own pace moved between its halves
    ks: list[float]
    sim: SimResult
    shape: Shape

    @property
    def slack(self) -> float:
        """The policy's hysteresis on a batch (`batch_slack`)."""
        return batch_slack(self.shape)

    def check_figures(self) -> None:
        """Samples/s, staleness and each worker's mean batch within the criterion and the run's drift, a batch
        within the policy's hysteresis more."""
        margin = TOLERANCE + self.drift
        for figure, r, s, ok in compare(self.real, self.sim, self.seen, margin, self.slack, self.shape.even_share):
            assert ok, (
                f"{figure}: real {r}, simulated {s} (within {100 * margin:.0f}%: the run's pace drifted "
                f"{100 * self.drift:.0f}%, a batch {100 * self.slack:.0f}% more); the workers' contention {self.ks}; "
                f"the shard {self.shard}; the real workers {self.seen}"
            )


def validated(shape: Shape, out: Path) -> Validated:
    """`shape` run for real into `out`, and in the simulator with what the run measured, the shard's service
    included."""
    curve = machine_curve(shape.model, shape.dataset, (16, shape.global_batch), steps=15)
    run = real_run(shape, out)
    assert all(o.steps for o in run.seen), f"every worker stepped: {run.seen}"
    ks = contentions(shape, run.seen, curve)
    return Validated(
        run.summary, run.seen, run.shard, run.drift, ks, simulated(shape, curve, run.seen, ks, run.shard), shape
    )


def test_the_simulator_gives_the_batches_staleness_and_samples_of_a_real_run_with_caps_and_fixed_costs(
    tmp_path: Path,
) -> None:
    validated(SHAPE, tmp_path).check_figures()


# LB-BSP (ssgd + dynamic): worker 0's share of the equal-time split is above its cap, so it trains its cap and the
# other two share the rest by their speeds; the CNN, whose compute dominates its step, on the synthetic set.
LBBSP = Shape(("1", "1", "4"), (8, 0, 0), "ssgd", "dynamic", global_batch=96, budget_s=12.0, model="cnn")
"""Worker 0's cap at a quarter of its share (about 38 of 96 at equal speed). Worker 2 at F = 4: an emulated F = 2
is (k + 1) / k times as slow as F = 1 only where both meet the same contention k, and beside a second suite (k 7
to 8) the F = 2 worker, sleeping half its compute, met up to one less: its steps per sample were the F = 1
worker's, and it took the larger share in the real run and in the simulator given each worker's own k. Twelve
seconds of training: a round is its slowest step, so the simulator is given each worker's spread, read from the
steps STATUS samples (every half second), about 18 a worker here. Over six seconds there were eight or nine, a
spread from so few moved several-fold from run to run, and CI's one failure of the six-second shape read the F = 4
worker's at the low end of that range (bench/RESULTS.md 63)."""


def test_lb_bsp_holds_a_capped_worker_at_its_cap_in_the_real_run_and_the_simulator(tmp_path: Path) -> None:
    v = validated(LBBSP, tmp_path)
    real = {w["name"]: w["final_batch"] for w in v.real["workers"].values()}
    cap = LBBSP.max_batches[0]
    assert real["worker0"] == cap == v.sim.worker_batches["sim0"], (real, v.sim.worker_batches)
    sim = {i: v.sim.worker_samples[f"sim{i}"] / v.sim.worker_steps[f"sim{i}"] for i in (1, 2)}
    times = [device_times(text, k) for text, k in zip(LBBSP.slowdowns, v.ks, strict=True)]
    if times[2] > (1 + v.slack) * times[1]:
        assert v.seen[1].batch > v.seen[2].batch and sim[1] > sim[2], (
            f"the F = 1 worker takes more of the rest than the F = 4 one: real {v.seen}, simulated {sim}"
        )
    # else the F = 4 worker, sleeping three quarters of its step, met so much less contention than the F = 1 one
    # that its device was as fast within the policy's hysteresis: either may take the larger share, and each
    # batch is still judged against the real one below
    v.check_figures()


# A busy shard: four workers of a 1 MB model whose compute is a millisecond of their step, so the shard serves a
# third or more of the time and its requests queue; the direction check off (the simulator has none, and on the
# flat model, never vouched for, its start-up hold throttled real runs to their slowest worker's stalls).
BUSY_SHARD = Shape(
    ("1",) * 4, (0,) * 4, "asgd", "fixed", global_batch=96, budget_s=8.0, model="flat:250000", direction_check=False
)


def test_a_busy_shards_queue_in_the_simulator_is_the_real_ones(tmp_path: Path) -> None:
    v = validated(BUSY_SHARD, tmp_path)
    assert v.shard.held_s > v.shard.service_s > 0, f"the real shard's requests queued: {v.shard}"
    assert v.shard.spread > 0, f"the shard reported its service's spread: {v.shard}"
    # Each asgd step is a push carrying the next pull: two whole-model transfers, which the shard counts itself in
    # parts of its model over however many messages they take (about one here: counting messages gives half). The
    # shard's and the workers' reports each lag by up to a heartbeat at either end of a stretch of a few seconds:
    # within a sixth of the workers' count (0.96 and 0.99 in two quiet runs).
    assert 0.85 <= v.shard.counted <= 1.2, f"the shard's own count of transfers is the workers': {v.shard}"
    pushed = [snap.shards["0"].pushed for snap in read_timeline(tmp_path / "real" / "timeline.json") if snap.shards]
    assert max(pushed) == len(BUSY_SHARD.slowdowns), f"the shard reported every worker's push: {pushed}"
    v.check_figures()


def _snapshot(
    t: float, steps: dict[str, int], busy_s: float, queued_s: float, squares: float, served: int
) -> JobStatus:
    """A STATUS snapshot with workers of these names and steps, and shard 0's serving seconds, its messages counting
    one transfer each."""
    workers = {f"w{i}": WorkerStatus(name=name, steps=n) for i, (name, n) in enumerate(steps.items())}
    shard = ShardStatus(
        "tcp://ps", 0, "", busy_s=busy_s, queued_s=queued_s, busy_sq_s=squares, served=served, transfers=served
    )
    return JobStatus(t=t, workers=workers, shards={"0": shard})


def test_the_shards_service_is_its_serving_seconds_over_the_transfers_after_the_first_fifth() -> None:
    # 15 steps a second make 30 transfers; from t = 2 on the shard serves each in 2 ms on average after 1 ms of
    # waiting, half of them in 1 ms and half in 3 ms, before it a slow start that the first fifth of the snapshots
    # leaves out
    timeline = [_snapshot(0, {"worker0": 0, "worker1": 0}, 0.0, 0.0, 0.0, 0)] + [
        _snapshot(t, {"worker0": 10 * t, "worker1": 5 * t}, 1.0 + 0.06 * t, 0.5 + 0.03 * t, 1.0 + 1.5e-4 * t, 30 * t)
        for t in range(1, 10)
    ]
    # at the end the workers leave STATUS one by one, the shard last: worker1's steps alone are not all the serving
    timeline.append(_snapshot(10, {"worker1": 50}, 1.7, 0.85, 1.0 + 1.5e-3, 300))
    timeline.append(JobStatus(t=11))  # the shards leave STATUS at the end
    seen = observed_shard(timeline)
    assert seen.service_s == pytest.approx(0.002), "2 ms of serving for each of a step's two transfers"
    assert seen.held_s == pytest.approx(0.003), "1 ms waiting and 2 ms served"
    assert seen.busy_share == pytest.approx(0.06), "60 ms of serving a second"
    assert seen.spread == pytest.approx(0.5) and seen.messages == pytest.approx(1.0), "1 and 3 ms: a 1 ms deviation"
    assert seen.counted == pytest.approx(1.0), "the shard counted the transfers the workers made"
    assert service_spread(0.06, 7.5e-5, 60, 30) == pytest.approx(0.5 / math.sqrt(2)), "0.5 and 1.5 ms, two a transfer"
    assert service_spread(0.06, 0.0, 30, 30) == 0.0, "no squares reported: no spread to give"
    assert observed_shard([JobStatus(t=0)]) == ShardSeen(), "no shard seen: nothing to give the simulator"


def test_a_runs_pace_is_judged_from_its_first_trained_sample() -> None:
    # the workers sit in STATUS for 3 s while they probe and wait for their first batches, then train 100 samples a
    # second for 10 s and 150 a second for the next 10
    start = [JobStatus(t=t, samples=0, workers={"w0": WorkerStatus(name="worker0")}) for t in range(3)]
    steady = [JobStatus(t=3 + t, samples=100 * t, workers={"w0": WorkerStatus(name="worker0")}) for t in range(1, 11)]
    faster = [
        JobStatus(t=13 + t, samples=1000 + 150 * t, workers={"w0": WorkerStatus(name="worker0")}) for t in range(1, 11)
    ]
    assert pace_drift(start + steady) == pytest.approx(0.0), "a steady pace after the start's wait"
    # past the first fifth of the 20 trained snapshots, halves from t = 8 to 16 (500 to 1,450 samples) and to 23
    assert pace_drift(start + steady + faster) == pytest.approx((1050 / 7) / (950 / 8) - 1), "100 samples/s, then 150"


def test_the_real_samples_per_second_are_those_of_the_stretch_the_simulator_is_given() -> None:
    # 2 s of probing in STATUS, then 100 samples a second; at the end worker1 leaves STATUS first, then worker0
    def snap(t: int, samples: int, names: tuple[str, ...]) -> JobStatus:
        return JobStatus(t=t, samples=samples, workers={f"w{i}": WorkerStatus(name=n) for i, n in enumerate(names)})

    both = ("worker0", "worker1")
    timeline = [snap(t, 0, both) for t in range(2)] + [snap(2 + t, 100 * t, both) for t in range(1, 11)]
    timeline += [snap(13, 1050, ("worker0",)), snap(14, 1050, ())]
    assert observed_rate(timeline) == pytest.approx(100.0), (
        "from t = 5 (a fifth into the trained snapshots) to 12, both workers in it"
    )
    assert observed_rate(timeline[:3]) == 0.0, "one trained snapshot: no stretch"
