"""Staleness counts: recording, summing, and the exact mean and p99 the benchmarks report."""

from __future__ import annotations

import pytest

from dynabatch.common import staleness
from dynabatch.common.staleness import STALENESS_BINS


def test_record_grows_the_list_and_caps_at_the_last_bin() -> None:
    counts: list[int] = []
    for s in (0, 2, 2, 500, -3):
        staleness.record(counts, s)
    assert counts[:3] == [2, 0, 2]
    assert len(counts) == STALENESS_BINS and counts[-1] == 1


def test_add_handles_lists_of_different_lengths() -> None:
    assert staleness.add([1, 2], [0, 0, 5]) == [1, 2, 5]
    assert staleness.add([1, 2, 3], [1]) == [2, 2, 3]


def test_mean_and_p99_are_exact() -> None:
    counts = [0] * 10
    counts[1] = 98
    counts[9] = 2  # 2% of updates 9 behind: p99 falls on them
    got = staleness.stats(counts)
    assert got.updates == 100
    assert got.mean == pytest.approx((98 * 1 + 2 * 9) / 100)
    assert got.p99 == 9
    counts[9] = 1
    counts[1] = 99
    assert staleness.stats(counts).p99 == 1
    assert staleness.stats([]).mean is None


def test_check_names_the_problem() -> None:
    assert staleness.check([1, 2]) is None
    negative, too_long = staleness.check([1, -2]), staleness.check([0] * (STALENESS_BINS + 1))
    assert negative is not None and "negative" in negative
    assert too_long is not None and "bins" in too_long
