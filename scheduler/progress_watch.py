"""Liveness is not progress: a worker whose heartbeat thread beats while its steps have stopped.

A worker heartbeats from a thread of its own (worker/pulse.py), so one whose data
loading blocks for ever, or whose main thread hangs in user code, stays live: under
a round protocol every round then waits for it until the round timeout, and a job's
end waits for its BYE, which never comes. A worker holding a batch that reports no
new step (nor a skipped one) for longer than its own steps allow is dropped from
rounds and from the end condition, with the reason logged.
"""

from __future__ import annotations

PROGRESS_STEPS = 20
"""Of its own measured steps, how many a worker holding a batch may go without finishing one."""
PROGRESS_FLOOR_FACTOR = 3.0
"""The least time allowed, in liveness timeouts: a worker between steps on a loaded machine (its step time
measured while it was less loaded) is not dropped for it."""


def progress_allowed_s(step_s: float, liveness_timeout_s: float, join_timeout_s: float) -> float:
    """Seconds a worker holding a batch may go without a step: PROGRESS_STEPS of its own last measured step,
    at least PROGRESS_FLOOR_FACTOR liveness timeouts, and before any step is measured (or past it) the join
    timeout, which bounds what a slow first step (loading, compiling) may take."""
    floor = PROGRESS_FLOOR_FACTOR * liveness_timeout_s
    if step_s <= 0:
        return max(floor, join_timeout_s)
    return max(floor, min(PROGRESS_STEPS * step_s, join_timeout_s))


def stalled(last_progress: float, now: float, step_s: float, liveness_timeout_s: float,
            join_timeout_s: float) -> bool:
    """Whether a worker whose steps last grew at `last_progress` (or that was last given a batch then) has made
    no progress for longer than `progress_allowed_s`."""
    return now - last_progress > progress_allowed_s(step_s, liveness_timeout_s, join_timeout_s)
