"""Liveness is not progress: a worker whose heartbeat thread beats while its steps have stopped.

A worker heartbeats from a thread of its own (worker/pulse.py), so one whose data
loading blocks for ever, or whose main thread hangs in user code, stays live: under
a round protocol every round then waits for it until the round timeout, and a job's
end waits for its BYE, which never comes. A worker holding a batch that reports no
new step (pushed, skipped or discarded) for longer than its own steps allow is dropped from
rounds and from the end condition, with the reason logged. An evaluator is judged
the same way by its evaluations, since the job's end waits for its final one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.scheduler.roster import Member

PROGRESS_STEPS = 20
"""Of its own measured steps, how many a worker holding a batch may go without finishing one."""
PROGRESS_FLOOR_FACTOR = 3.0
"""The least time allowed, in liveness timeouts: a worker between steps on a loaded machine (its step time
measured while it was less loaded) is not dropped for it."""


def progressed(prev: WorkerHeartbeat, hb: WorkerHeartbeat) -> bool:
    """Whether `hb` reports a step that `prev` did not: one whose gradient was pushed, one skipped because its loss
    was not finite, or one whose push the shards answered without applying it (WorkerHeartbeat.discarded). A
    discarded step trained nothing, but its worker is computing: under Ringmaster a worker far slower than the rest
    has every gradient discarded as too stale, and dropping it as stuck would only make it register again."""
    return hb.steps != prev.steps or hb.skipped != prev.skipped or hb.discarded != prev.discarded


def progress_allowed_s(step_s: float, liveness_timeout_s: float, join_timeout_s: float) -> float:
    """Seconds a worker holding a batch may go without a step: PROGRESS_STEPS of its own last measured step,
    at least PROGRESS_FLOOR_FACTOR liveness timeouts, and before any step is measured (or past it) the join
    timeout, which bounds what a slow first step (loading, compiling) may take."""
    floor = PROGRESS_FLOOR_FACTOR * liveness_timeout_s
    if step_s <= 0:
        return max(floor, join_timeout_s)
    return max(floor, min(PROGRESS_STEPS * step_s, join_timeout_s))


def stalled(last_progress: float, now: float, step_s: float, liveness_timeout_s: float, join_timeout_s: float) -> bool:
    """Whether a worker whose steps last grew at `last_progress` (or that was last given a batch then) has made
    no progress for longer than `progress_allowed_s`."""
    return now - last_progress > progress_allowed_s(step_s, liveness_timeout_s, join_timeout_s)


EVAL_ROUNDS = 3
"""Of its own measured evaluations, how many an evaluator may take over one before it is judged wedged."""


def evaluation_allowed_s(
    eval_s: float, eval_interval_s: float, liveness_timeout_s: float, join_timeout_s: float
) -> float:
    """Seconds an evaluator may go without reporting an evaluation.

    Its heartbeat thread keeps it live while its main thread hangs (loading the test set, a user's metric), and a
    job's end waits for its final evaluation: without this bound, for ever. Before its first evaluation is
    measured (`eval_s` 0), the join timeout bounds loading the task, its data and its model, as for a worker's
    first step; after it, its interval plus EVAL_ROUNDS of its own measured evaluation, at least
    PROGRESS_FLOOR_FACTOR liveness timeouts (a shard restarting meanwhile) and at most the join timeout.
    """
    floor = PROGRESS_FLOOR_FACTOR * liveness_timeout_s
    if eval_s <= 0:
        return max(floor, join_timeout_s)
    return eval_interval_s + max(floor, min(EVAL_ROUNDS * eval_s, join_timeout_s))


def measured_eval_s(previous_s: float, since_last_s: float, eval_interval_s: float, first: bool) -> float:
    """An evaluator's evaluation time, measured by the scheduler from when its reports arrive.

    The first report comes `since_last_s` after its WELCOME: loading and one evaluation, an upper bound of an
    evaluation. A later one comes an interval after the previous report plus the evaluation itself; one that came
    sooner (a skipped evaluation retried, the final one called early) measures nothing and keeps `previous_s`.
    """
    if first:
        return since_last_s
    took = since_last_s - eval_interval_s
    return took if took > 0 else previous_s


def stuck_workers(
    workers: Iterable[Member], batch_of: Callable[[str], int], now: float, job: JobConfig
) -> list[tuple[Member, str]]:
    """The workers holding a batch (`batch_of`) that finished no step for longer than `stalled` allows, each
    with why."""
    return [
        (
            m,
            f"{m.id} ({m.name}) holds batch {batch_of(m.id)} but finished no step for {now - m.progress_since:.0f} s "
            f"(its steps take {m.last.times.step_s:.3f} s)",
        )
        for m in workers
        if batch_of(m.id) > 0
        and stalled(m.progress_since, now, m.last.times.step_s, job.liveness_timeout_s, job.join_timeout_s)
    ]


def wedged_evaluators(evaluators: Iterable[Member], now: float, job: JobConfig) -> list[tuple[Member, str]]:
    """The evaluators that reported no evaluation for longer than their own evaluations allow
    (`evaluation_allowed_s`) while their heartbeats went on, each with why: the job's end never waits on one for
    ever."""
    wedged = []
    for m in evaluators:
        allowed = evaluation_allowed_s(m.eval_s, job.eval_interval_s, job.liveness_timeout_s, job.join_timeout_s)
        quiet = now - (m.progress_at or m.joined)
        if quiet <= allowed:
            continue
        measured = f"its evaluations take {m.eval_s:.1f} s" if m.progress_at else "before its first evaluation"
        wedged.append(
            (
                m,
                f"evaluator {m.id} ({m.name}) reported no evaluation for {quiet:.1f} s (allowed {allowed:.1f} s, "
                f"{measured}) while its heartbeats went on",
            )
        )
    return wedged
