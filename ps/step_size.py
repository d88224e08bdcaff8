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


def staleness_step(rule: str, staleness: int) -> float:
    """The factor on an asynchronous gradient's step for its `staleness` tau under `rule` (STALENESS_STEPS).

    `delay` is the staleness-aware step of Zhang et al. (IJCAI 2016), lr / max(1, tau), the damping softsync
    applies within its rounds, here on each gradient as it arrives. Asynchronous SGD's step bounds fall as
    the delays grow (Mishchenko et al. and Koloskova et al., 2022), and with n workers a gradient is about n - 1
    versions stale, so a step tuned at one n is too large at four times it (bench/RESULTS.md 9h: DBS-SGD at 256
    workers at the 64-worker step). Divided by tau, the n gradients that land while one is computed move the
    model about lr between them whatever n is, so the step size carries over between cluster sizes; a gradient
    staler than the others, a slow worker's, moves it less. Its step size is then one per B samples, as a round
    protocol's is (bench/tuned_study.py tunes it on that grid).
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if rule == "constant":
        return 1.0
    if rule == "delay":
        return 1.0 / max(1, staleness)
    raise ValueError(f"unknown staleness step {rule!r}; choose constant or delay")


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
