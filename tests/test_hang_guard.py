"""The suite's hang guards grow with the machine's load (tests/hang_guard.py), pytest's own timeout among them."""

from __future__ import annotations

import pytest

from hang_guard import hang_guard_s, load_per_core


def test_a_guard_is_its_quiet_seconds_times_the_load_per_core_and_never_less() -> None:
    before = load_per_core()
    guard = hang_guard_s(60)
    after = load_per_core()
    assert 60 * min(before, after) - 1e-9 <= guard <= 60 * max(before, after) + 1e-9
    assert min(before, after) >= 1.0


def test_pytests_timeout_for_this_test_is_the_configured_one_scaled(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    configured = float(request.config.getini("timeout"))
    assert marker is not None and configured == 300
    assert configured <= marker.args[0] <= configured * max(load_per_core(), 1.0) * 2, marker.args
