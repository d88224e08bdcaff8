"""The suite's hang guards grow with the machine's load and end by the running test's own limit
(tests/hang_guard.py), pytest's timeout among them (tests/conftest.py)."""

from __future__ import annotations

import pytest
from pytest_timeout import get_env_settings

import hang_guard
from hang_guard import hang_guard_s, load_per_core, scaled_s


def test_a_guard_is_its_quiet_seconds_times_the_load_per_core_and_never_less() -> None:
    before = load_per_core()
    guard = scaled_s(60)
    after = load_per_core()
    assert 60 * min(before, after) - 1e-9 <= guard <= 60 * max(before, after) + 1e-9
    assert min(before, after) >= 1.0


def test_pytests_timeout_for_this_test_is_the_configured_one_scaled(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    configured = get_env_settings(request.config).timeout
    assert marker is not None and configured
    assert configured <= marker.args[0] <= configured * load_per_core() * 2, (marker.args, configured)


def test_no_guard_set_during_a_test_outlasts_the_test(request: pytest.FixtureRequest) -> None:
    limit = request.node.get_closest_marker("timeout").args[0]
    assert hang_guard_s(10 * limit) <= limit, "a guard past the test's limit would never fire"
    assert hang_guard_s(1) >= 1.0


def test_a_limit_holds_while_it_is_entered_and_the_one_outside_it_after(request: pytest.FixtureRequest) -> None:
    outer = request.node.get_closest_marker("timeout").args[0]
    with hang_guard.within_test_limit(5.0) as limit:
        assert limit >= 5.0 and hang_guard_s(10**6) <= limit
    assert limit < hang_guard_s(10**6) <= outer, "the test's own limit again"
