"""What one step took, phase by phase: the worker measures it, its HEARTBEAT carries it, STATUS shows it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepTimes:
    """Seconds of one step: the whole step (`step_s`) and each phase of it.

    `wait_s` is time blocked on other workers (a round), `data_s` time waiting for the step's samples (loading,
    collating, copying them to the device), part of the worker's own work. A worker's loops time the phases of a
    step, or of a local round of H steps, and leave `step_s` at 0: `per_step` makes them one step's, with `step_s`
    their sum, which is what the worker reports.
    """

    step_s: float = 0.0
    compute_s: float = 0.0
    pull_s: float = 0.0
    push_s: float = 0.0
    wait_s: float = 0.0
    data_s: float = 0.0

    def per_step(self, steps: int) -> StepTimes:
        """The phases timed over `steps` steps as one step's (a local round's spread over its H), `step_s` their
        sum, so that `step_s - wait_s` is always one step of the worker's own work."""
        phases = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step_s"}
        return StepTimes(step_s=sum(phases.values()) / steps, **{name: s / steps for name, s in phases.items()})


PHASES = tuple(f.name.removesuffix("_s") for f in fields(StepTimes))
"""The metrics' phase labels (`step`, not `step_s`): the whole step, then each phase of it."""
