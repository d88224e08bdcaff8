"""A job that trains nothing for too long ends with an error, instead of running on silently.

Liveness is not progress: a worker's heartbeat thread keeps it live while every
one of its steps fails or is skipped. The job's progress is its sample count;
while training should go on (it started, it is not stopping, workers are live)
and that count does not move for `stall_limit_s`, the job has stalled. The
limit follows the workers' measured steps (`STALL_STEPS` of the slowest), and is
never below the join timeout: a shard restarting from its checkpoint may take
that long, and workers cannot push meanwhile.
"""

from __future__ import annotations

STALL_STEPS = 50  # steps of the slowest live worker the job may go without training a sample


def stall_limit_s(step_s: list[float], floor_s: float) -> float:
    """Seconds without a trained sample after which the job has stalled, given live workers' step times."""
    return max(floor_s, STALL_STEPS * max(step_s, default=0.0))


class StallWatch:
    """When the job's sample count last moved, while it should be training."""

    def __init__(self) -> None:
        self.samples = -1
        self.since: float | None = None

    def observe(self, samples: int, now: float, training: bool) -> float:
        """Seconds the count has stood still while the job was training (0 while it is not)."""
        if not training or samples != self.samples or self.since is None:
            self.samples, self.since = samples, now
        return now - self.since
