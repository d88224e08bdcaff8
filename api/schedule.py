"""Learning-rate schedules as functions of global progress (epoch / epochs, from 0 to 1).

Progress is the job's, counted by the scheduler from every worker's samples, so a
worker that joins late or a shard that restarts applies the same multiplier as
everyone else at that point of the job. A schedule returns the factor the base
learning rate is multiplied by.

`dynabatch.schedule`: what `__all__` names is the promise to users; the wire form
(`schedule_fields`, `schedule_from_fields`) is the shards' and stays beside the schedules it builds.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Schedule", "constant", "warmup_cosine", "step"]


@dataclass(frozen=True)
class Schedule:
    """A named schedule with its parameters (plain data: it travels to the shards)."""

    name: str = "constant"
    warmup: float = 0.0
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1

    def factor(self, progress: float) -> float:
        """The learning-rate multiplier at `progress` (clamped to [0, 1])."""
        p = min(1.0, max(0.0, progress))
        if self.name == "warmup_cosine":
            if p < self.warmup:
                return p / self.warmup
            span = max(1e-12, 1.0 - self.warmup)
            return 0.5 * (1.0 + math.cos(math.pi * (p - self.warmup) / span))
        if self.name == "step":
            return self.gamma ** bisect.bisect_right(self.milestones, p)
        return 1.0


def constant() -> Schedule:
    """The base learning rate throughout."""
    return Schedule("constant")


def _number(where: str, value: Any) -> float:
    """`value` as a float; ValueError naming `where` for what is not a number (a bool, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)


def warmup_cosine(warmup: float = 0.05) -> Schedule:
    """Linear warm-up over the first `warmup` of the job, then cosine decay to zero."""
    warmup = _number("warmup_cosine: warmup", warmup)
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup_cosine: warmup must be a fraction in [0, 1), got {warmup}")
    return Schedule("warmup_cosine", warmup=warmup)


def step(milestones: list[float], gamma: float = 0.1) -> Schedule:
    """Multiply by `gamma` at each milestone (fractions of the job, ascending); gamma in [0, 1] (a negative one
    would turn every step round, one above 1 grow it)."""
    if not isinstance(milestones, (list, tuple)):
        raise ValueError(f"step: milestones must be a list of fractions of the job, got {milestones!r}")
    ms = tuple(_number("step: a milestone", m) for m in milestones)
    if list(ms) != sorted(ms) or any(not 0.0 <= m <= 1.0 for m in ms):
        raise ValueError(f"step: milestones must be ascending fractions in [0, 1], got {list(milestones)}")
    gamma = _number("step: gamma", gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"step: gamma must lie in [0, 1], got {gamma}")
    return Schedule("step", milestones=ms, gamma=gamma)


SCHEDULES = ("constant", "warmup_cosine", "step")


def schedule_fields(schedule: Schedule | None) -> dict[str, Any]:
    """A schedule as plain data for the wire (empty: constant)."""
    return (
        {}
        if schedule is None
        else {
            "name": schedule.name,
            "warmup": schedule.warmup,
            "milestones": list(schedule.milestones),
            "gamma": schedule.gamma,
        }
    )


def schedule_from_fields(fields: dict[str, Any]) -> Schedule:
    """A schedule received from a peer; ValueError naming what is wrong."""
    unknown = set(fields) - {"name", "warmup", "milestones", "gamma"}
    if unknown:
        raise ValueError(f"schedule has unknown fields {sorted(unknown)}")
    name = fields.get("name", "constant")
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    try:
        milestones = tuple(float(m) for m in fields.get("milestones", ()))
        warmup, gamma = float(fields.get("warmup", 0.0)), float(fields.get("gamma", 0.1))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"schedule fields: {exc}") from None
    if name == "warmup_cosine":
        return warmup_cosine(warmup)
    if name == "step":
        return step(list(milestones), gamma)
    return constant()
