"""A worker Ringmaster would always discard is idled (common/planning/discarded_workers.py, scheduler/idle_workers.py):
the rule directly, the scheduler's evidence, the allocation and STATUS, and the predictor."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import harness
from dynabatch.cluster.progress import format_progress
from dynabatch.common.config import JobConfig
from dynabatch.common.planning.discarded_workers import delays, discarded_workers
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.prediction import Cluster, Node, predict
from dynabatch.scheduler.idle_workers import IDLE_AFTER, IdleWorkers
from dynabatch.scheduler.job_state import JobState
from harness import metric_value, mlp_job, run_job, trained_its_epochs, wait_for
from test_job_state import _job, _join, _shards_apply, _step


def test_a_worker_whose_every_step_reaches_r_is_named_with_its_mean_and_least_delay() -> None:
    # the two 1 s workers make 8 versions during one step of the 4 s worker, whatever the phase: at least R = 3
    c = discarded_workers({"a": 1.0, "b": 1.0, "c": 4.0}, 3)["c"]
    assert (c.mean, c.least, c.always) == (8.0, 8, True)
    assert c.reason == "Ringmaster would discard its steps: delay 8.0 >= R 3"


def test_a_worker_some_of_whose_steps_count_is_beyond_r_on_average_but_not_always() -> None:
    # mean delay 2 x 1 / 1.5 = 3 reaches R = 3, so some of its steps are discarded; but the others complete only one
    # whole step each within one of its steps, depending on the phase, so its least delay is 2 and some count
    c = discarded_workers({"a": 1.0, "b": 1.0, "c": 1.5}, 3)["c"]
    assert c.mean == pytest.approx(3.0) and (c.least, c.always) == (2, False)
    assert discarded_workers({"a": 1.0, "b": 1.0, "c": 1.0}, 3) == {}
    assert discarded_workers({"a": 9.0}, 1) == {}, "the fastest worker is always kept"


def test_a_worker_comes_back_when_a_faster_one_leaves_or_the_others_slow_down() -> None:
    r, cluster = 4, {"a": 1.0, "b": 1.0, "c": 2.5}  # --max-delay 4: R does not follow the workers
    assert delays(cluster, r)["c"].always, "least delay 2 + 2"
    for changed, why in (({"a": 1.0, "c": 2.5}, "b left: 2.5 versions"), ({**cluster, "a": 2.0, "b": 2.0}, "slowed")):
        idle = IdleWorkers()
        idle.report("c", steps=1, discarded=0)
        idle.report("c", steps=1, discarded=IDLE_AFTER)
        assert idle.judge(cluster, r) and "c" in idle.idle
        assert delays(changed, r)["c"].mean <= r - 1 and idle.judge(changed, r) and idle.idle == {}, why
    assert delays({**cluster, "a": 1.5, "b": 1.5}, r)["c"].mean == pytest.approx(2.5 * 2 / 1.5), "still above R - 1"


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
    band = {**steps, "c": 1.25}  # mean delay 2.5: above R - 1, its least (2) below R: it stays as it is
    assert not idle.judge(band, 3) and "c" in idle.idle
    assert idle.judge({**steps, "a": 4.0, "b": 4.0}, 3) and idle.idle == {}, "mean delay 2 = R - 1: it is back"
    assert not idle.judge(steps, 3), "back, it needs fresh evidence before it is idled again"
    idle.report("c", steps=6, discarded=3 * IDLE_AFTER + 1)
    assert not idle.judge(band, 3), "some of its steps would count: it is not idled"
    assert idle.judge(steps, 3) and "c" in idle.idle
    assert idle.judge(None, 3) and idle.idle == {}, "a protocol that discards nothing for its delay: none is idle"
    idle.forget("c")
    assert idle.discarded_in_a_row("c") == 0


def _discarding(policy: str, applied: int, discarded: int) -> tuple[JobState, list[str], str, float]:
    """A Ringmaster job (R = 3) of two workers stepping 0.05 s and one 0.2 s: each takes `applied` steps, then the
    slow one's next `discarded` are discarded while the others step on. Returns the job, the fast, the slow, the
    time."""
    state = _job(protocol="ringmaster", batch_policy=policy, max_delay=3, epochs=1000.0)
    fast = [_join(state, 1000.0), _join(state, 1000.0)]
    slow = _join(state, 250.0)
    now = 0.0
    for _ in range(applied):
        now += 0.2
        for wid in [*fast, slow]:
            _step(state, wid, 0.2 if wid == slow else 0.05, now)
    last = state.roster.members[slow].last
    for n in range(1, discarded + 1):
        now += 0.2
        state.heartbeat(slow, replace(last, discarded=n), now)
        for wid in fast:
            _step(state, wid, 0.05, now)
        _shards_apply(state, now)
    return state, fast, slow, now


def test_a_ringmaster_job_gives_an_always_discarded_worker_no_batch_says_why_and_takes_it_back() -> None:
    state, fast, slow, now = _discarding("fixed", applied=3, discarded=IDLE_AFTER - 1)
    assert state.allocator.batch_of(slow) > 0, "not enough discarded steps in a row yet: it trains"
    state, fast, slow, now = _discarding("fixed", applied=3, discarded=IDLE_AFTER)
    assert state.allocator.allocation == {fast[0]: 32, fast[1]: 32, slow: 0}, "the others keep their batches"
    shown = state.status(now).workers[slow]
    assert shown.batch == 0 and shown.idle.startswith("Ringmaster would discard its steps: delay ")
    assert shown.idle.endswith(" >= R 3") and f"idle ({shown.idle})" in format_progress(state.status(now), now)
    assert shown.samples_per_s == 0 < state.status(now).workers[fast[0]].samples_per_s, "it trains nothing now"
    decision = state.allocator.decisions[-1]
    assert decision.reason.endswith("; idle: Ringmaster would discard their steps") and decision.batches[slow] == 0
    assert state.expire(now + 1.0) == [] and not state.roster.members[slow].left, "idle, not dropped"
    last = state.roster.members[slow].last
    for _ in range(20):  # the fast workers slow to 0.25 s a step: 2 x 0.2 / 0.25 = 1.6 versions during one of its
        now += 0.2
        for wid in fast:
            _step(state, wid, 0.25, now)
        state.heartbeat(slow, last, now)
        _shards_apply(state, now)
    back = state.status(now).workers[slow]
    assert state.allocator.batch_of(slow) > 0 and back.idle == "" and back.samples_per_s > 0


def test_auto_chooses_again_with_an_idle_worker_measured_as_far_as_it_will_be() -> None:
    """An idle worker reports no more steps: auto does not wait for its eighth, but counts it at its last speed."""
    state, _, slow, _ = _discarding("auto", applied=2, discarded=IDLE_AFTER + 11)
    assert state.allocator.idled.idle.keys() == {slow}
    auto = state.allocator.auto
    assert auto is not None
    assert "until every worker" not in auto.reason and "measured workers: 3" in auto.reason, auto.reason


def test_the_predictor_idles_the_worker_ringmaster_would_discard_and_counts_nothing_of_it() -> None:
    gpu, slow = Device(0.02, 0.0005), Device(0.2, 0.005)
    mixed = Cluster((Node(gpu),) * 3 + (Node(slow),), 256)
    ring = predict(mixed, STUDY_NOISE, "ringmaster", "fixed")
    assert ring.batches == (64, 64, 64, 0) and ring.step_s[3] == 0, "idle; the others keep their batches"
    assert ring.discarded == 0, "the idle worker computes nothing, so nothing computed is discarded"
    fast_alone = predict(Cluster((Node(gpu),) * 3, 192), STUDY_NOISE, "ringmaster", "fixed")
    assert ring.samples_per_s == pytest.approx(fast_alone.samples_per_s), "its throughput counts for nothing"
    assert ring.time_s == pytest.approx(fast_alone.time_s)


@pytest.mark.slow
def test_a_real_ringmaster_job_idles_its_far_slower_worker_says_so_and_trains_exactly_its_epochs(
    tmp_path: Path,
) -> None:
    """Three workers, one 16x slower and 0.1 s more a step, fixed batches of 512 (compute, not transfers, dominates
    the MLP's step at that size, so the emulated slowdown shows): every gradient of the slow worker arrives about 2 x
    its step over theirs versions stale, above R = 3. The fixed 0.1 s keeps it so on a loaded machine, where the
    fast workers' compute meets more contention than the slow one's, which sleeps between (16x alone measured 1.7x
    their step beside a second suite), and 16 epochs leave the job time to show it stop. It is idled once
    IDLE_AFTER of its steps were discarded in a row: its batch is 0, the console and STATUS say why, it stops
    computing (its discarded steps stop once a heartbeat has brought it batch 0 and the steps it had on their way have
    passed), it is never dropped, and the job trains exactly its epochs."""
    run, out = run_job(
        tmp_path,
        "r",
        *mlp_job(16, "1", "1", "16:0.1"),
        "--global-batch",
        "1536",
        "--protocol",
        "ringmaster",
        "--batch-policy",
        "fixed",
        "--eval-interval-s",
        "600",
    )
    summary = trained_its_epochs(run)
    assert summary["overshoot_samples"] == 0, summary
    timeline = json.loads((run / "timeline.json").read_text())
    slow = next(wid for wid, w in summary["workers"].items() if w["name"] == "worker2")
    steps_s = {w["name"]: w["mean_step_s_after_warmup"] for w in summary["workers"].values()}
    idle = [s for s in timeline if s["workers"].get(slow, {}).get("idle")]
    assert idle, f"never idled; each worker's mean step (s): {steps_s}"
    assert idle[0]["workers"][slow]["idle"].startswith("Ringmaster would discard its steps: delay ")
    assert "worker2(16x:0.1s) idle (Ringmaster would discard its steps: delay" in out
    assert all(s["workers"][slow]["batch"] == 0 for s in idle)
    assert not any(slow in s["departed"] for s in timeline if not s["stopping"]), "idle, not dropped"
    # Its step as this run measured it: every step it took was discarded, and a discarded step reports no phase
    # times (its STATUS step_s is 0), so the seconds per discarded step from its first batch to its idling. Once a
    # heartbeat's answer has brought it batch 0, the steps it had on its way have ended, and a heartbeat has counted
    # the last of them, it computes nothing.
    given = next(s for s in timeline if s["workers"].get(slow, {}).get("batch", 0) > 0)
    per_step = (idle[0]["t"] - given["t"]) / idle[0]["workers"][slow]["discarded"]
    settled = idle[0]["t"] + 2 * JobConfig().heartbeat_s + 3 * per_step
    after = [s for s in timeline if s["t"] >= settled]
    assert after and not after[0]["stopping"], (
        f"the job ended too soon after idling its worker to see it stop: {steps_s}, {per_step:.2f} s a discarded step"
    )
    counts = {(s["workers"][slow]["discarded"], s["workers"][slow]["samples"]) for s in after if slow in s["workers"]}
    assert len(counts) == 1, f"its discarded steps or its samples grew after it was idle: {counts}"
    assert idle[0]["workers"][slow]["discarded"] >= IDLE_AFTER


SPEEDS = (("fast1", "1"), ("fast2", "1"), ("slow", "16:0.1"))  # as the real job's above, for a loaded machine
REASONS = ("too_stale", "held", "switched")


def test_prometheus_sees_the_idle_worker_as_idle_and_training_nothing(tmp_path: Path) -> None:
    """The scheduler's /metrics says what STATUS says: `dynabatch_worker_idle` is 1 for the worker Ringmaster would
    always discard and 0 for the others, and its samples/s is 0, where its last step's speed would read as current
    on a dashboard; the idle worker's own /metrics counts its discarded steps as too stale. The job and its workers
    are the real test's above, as separate processes."""
    c = harness.Cluster(
        tmp_path,
        [*mlp_job(1000), "--global-batch", "1536", "--protocol", "ringmaster", "--batch-policy", "fixed"]
        + ["--eval-interval-s", "600"],
    )
    try:
        scheduler = c.scheduler()
        c.shard()
        workers = {name: c.worker(name, "--slowdown", slowdown) for name, slowdown in SPEEDS}
        st = c.wait_status("the slow worker idled", lambda s: any(w.idle for w in s.workers.values()), 180.0)
        idle = {wid for wid, w in st.workers.items() if w.idle}
        assert [st.workers[wid].name for wid in idle] == ["slow"], st.workers

        def exported() -> str | None:
            """The metrics once the idle worker is exported idle and every other has a step in its last report (on a
            loaded machine a fast worker's report can come between its steps' for a while)."""
            text = scheduler.metrics()
            steps = [metric_value(text, "dynabatch_worker_samples_per_second", worker=w) for w in st.workers]
            if not all(metric_value(text, "dynabatch_worker_idle", worker=wid) == 1 for wid in idle):
                return None
            return text if all(s > 0 for w, s in zip(st.workers, steps, strict=True) if w not in idle) else None

        text = wait_for("the idle worker exported as idle, the others with a speed", exported)
        for wid in st.workers:
            assert metric_value(text, "dynabatch_worker_idle", worker=wid) == (1.0 if wid in idle else 0.0), wid
            speed = metric_value(text, "dynabatch_worker_samples_per_second", worker=wid)
            assert (speed == 0) == (wid in idle), (wid, speed)
        own = workers["slow"].metrics()
        discarded = {r: metric_value(own, "dynabatch_worker_discarded_steps_total", reason=r) for r in REASONS}
        assert discarded["too_stale"] >= IDLE_AFTER and discarded["switched"] == 0, discarded
        assert all(f'reason="{r}"' in own for r in REASONS), "every reason exported, at 0 until it happens"
    finally:
        c.stop()
