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


def async_weight(rule: str, weight: float, staleness: int, samples: int, delay_step_samples: int) -> float:
    """An asynchronous gradient's factor on lr: its batch `weight` times `staleness_step(rule, staleness)`, and
    under `delay` at most `samples / delay_step_samples`.

    Why the bound: the delay step keeps the step per B samples about lr where every worker's gradients are stale
    alike, but where a few workers make nearly every update their gradients are rarely stale, and each takes nearly
    the whole lr however few samples it holds: a small gradient then moves the model far more per sample than the
    task tolerates, and the job may diverge (bench/RESULTS.md 48, 49). Asynchronous SGD's step bounds are the
    smaller of a delay term and a noise term linear in the gradient's batch (Koloskova et al. and Mishchenko et al.,
    2022; the small-batch regime of McCandlish et al., 2018), and this is the second: lr per `delay_step_samples`
    samples at most, the task's figure, not the cluster's.
    """
    factor = weight * staleness_step(rule, staleness)
    return min(factor, samples / delay_step_samples) if rule == "delay" else factor


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
