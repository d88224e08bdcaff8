"""What one step (or one round of local steps) took, as the worker reports it."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.wire.step_times import StepTimes


@dataclass
class StepResult:
    """A finished step: `steps` local steps of `batch` samples each (1 for gradient protocols), and the seconds of
    its phases over all of them (`times`; the loops time pull, compute, push and wait, the worker itself `data_s`,
    since it owns the batches)."""

    times: StepTimes
    batch: int
    loss: float
    version: int
    steps: int = 1
