"""Learning-rate schedules by global progress, and how they travel to the shards."""

from __future__ import annotations

import math
from typing import Any

import pytest

import dynabatch as db
from dynabatch.schedule import Schedule, schedule_fields, schedule_from_fields


def test_warmup_cosine_rises_linearly_then_decays_to_zero() -> None:
    s = db.schedule.warmup_cosine(warmup=0.2)
    assert s.factor(0.0) == 0.0 and s.factor(0.1) == pytest.approx(0.5) and s.factor(0.2) == pytest.approx(1.0)
    assert s.factor(0.6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.factor(1.0) == pytest.approx(0.0, abs=1e-12) and s.factor(7.0) == s.factor(1.0)


def test_step_multiplies_by_gamma_at_each_milestone() -> None:
    s = db.schedule.step(milestones=[0.5, 0.75], gamma=0.1)
    assert [s.factor(p) for p in (0.0, 0.49, 0.5, 0.8)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    assert db.schedule.constant().factor(0.3) == 1.0


@pytest.mark.parametrize(
    "schedule", [None, db.schedule.constant(), db.schedule.warmup_cosine(0.1), db.schedule.step([0.3, 0.6], 0.5)]
)
def test_a_schedule_survives_the_wire(schedule: Schedule | None) -> None:
    back = schedule_from_fields(schedule_fields(schedule))
    assert back == (schedule or db.schedule.constant())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "exponential"}, "not one of"),
        ({"name": "step", "milestones": [0.6, 0.3]}, "ascending"),
        ({"name": "warmup_cosine", "warmup": 1.5}, "fraction"),
        ({"name": "constant", "gamma": "x"}, "schedule fields"),
        ({"name": "constant", "extra": 1}, "unknown fields"),
    ],
)
def test_a_malformed_schedule_from_a_peer_is_refused_by_name(fields: Any, message: str) -> None:  # as a peer sends
    with pytest.raises(ValueError, match=message):
        schedule_from_fields(fields)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: db.schedule.step([0.5], gamma=-1), r"gamma must lie in \[0, 1\]"),  # turned every step round
        (lambda: db.schedule.step([0.5], gamma=math.nan), "gamma must lie in"),
        (lambda: db.schedule.step(0.5), "milestones must be a list"),  # type: ignore[arg-type]
        (lambda: db.schedule.warmup_cosine("0.1"), "warmup must be a number"),  # type: ignore[arg-type]
    ],
)
def test_a_schedule_that_cannot_train_is_refused_where_it_is_written(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
