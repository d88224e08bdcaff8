"""What one step (or one round of local steps) took, as the worker reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    """Seconds spent in each phase; `wait` is time blocked on other workers (a round), `data` time
    waiting for the step's samples (loading, collating, copying them to the device).

    The loops time the first four; the worker itself times `data`, since it owns the batches.
    """

    pull: float = 0.0
    compute: float = 0.0
    push: float = 0.0
    wait: float = 0.0
    data: float = 0.0

    @property
    def total(self) -> float:
        return self.pull + self.compute + self.push + self.wait + self.data


@dataclass
class StepResult:
    """A finished step: `steps` local steps of `batch` samples each (1 for gradient protocols)."""

    times: StepTimes
    batch: int
    loss: float
    version: int
    steps: int = 1
