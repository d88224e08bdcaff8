"""The per-source registration bucket, driven by explicit clocks."""

from __future__ import annotations

import pytest

from dynabatch.common.wire.frames import ProtocolError
from dynabatch.scheduler.hello_rate import HelloRate


def _spend_all(rate: HelloRate, source: str, now: float) -> int:
    spent = 0
    while True:
        try:
            rate.spend(source, now)
        except ProtocolError as exc:
            assert exc.code == "hello_rate" and "retry in" in str(exc)
            return spent
        spent += 1


def test_a_source_gets_its_burst_at_once_then_per_s_and_others_are_untouched() -> None:
    rate = HelloRate(per_s=2.0, burst=5)
    assert _spend_all(rate, "10.0.0.1", 100.0) == 5
    assert _spend_all(rate, "10.0.0.2", 100.0) == 5, "each source has a bucket of its own"
    assert _spend_all(rate, "10.0.0.1", 100.4) == 0
    assert _spend_all(rate, "10.0.0.1", 101.0) == 2, "2/s, counted from the last registration: refusals cost nothing"
    assert _spend_all(rate, "10.0.0.1", 1000.0) == 5, "it refills to the burst, never beyond"


def test_a_refused_registration_spends_nothing() -> None:
    rate = HelloRate(per_s=1.0, burst=1)
    rate.spend("a", 0.0)
    for t in (0.1, 0.2, 0.3):
        with pytest.raises(ProtocolError):
            rate.spend("a", t)
    rate.spend("a", 1.0)


def test_the_source_table_is_bounded_forgetting_refilled_sources_first() -> None:
    rate = HelloRate(per_s=1.0, burst=3, max_sources=4)
    for i in range(4):
        rate.spend(f"idle{i}", 0.0)
    for _ in range(3):
        rate.spend("busy", 0.0)  # the fifth source: the oldest (idle0) is forgotten
    rate.spend("late", 2.5)  # every idle bucket has refilled by now, busy's has not: they go, it stays
    assert list(rate._buckets) == ["busy", "late"] and rate.tokens("busy", 2.5) == 2.5
    for i in range(1000):
        rate.spend(f"s{i}", 3.0)
    assert len(rate._buckets) == 4
