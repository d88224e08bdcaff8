"""The factor a shard multiplies every update's learning rate by, without sockets.

Two things set it: the task's schedule at the job's progress (epoch / epochs), and
the job's own factor after its rollbacks (halved at each, from the scheduler). The
scheduler's progress arrives with the answers to the shard's heartbeats; between
them the shard's own count of the samples pushed to it moves the schedule on, so a
short job is not trained entirely at the schedule's first value (a warm-up's 0).
Progress only moves forward: a rollback restores the model, not the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynabatch.schedule import Schedule


@dataclass
class StepSize:
    """The task's schedule, the job's progress through it, and the job's factor after rollbacks."""

    schedule: Schedule = field(default_factory=Schedule)
    progress: float = 0.0  # epoch / epochs as far as this shard knows, in [0, 1]
    job_factor: float = 1.0  # the scheduler's step-size factor after the job's rollbacks

    @property
    def factor(self) -> float:
        """The learning-rate multiplier now: schedule(progress) x the job's factor."""
        return self.schedule.factor(self.progress) * self.job_factor

    def advance(self, progress: float) -> None:
        """Move the schedule forward to `progress` (clamped to 1), never back."""
        self.progress = max(self.progress, min(1.0, progress))
