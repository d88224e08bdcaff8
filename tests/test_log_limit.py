"""Refused messages are logged at a bounded rate, with a summary of what was left out."""

from __future__ import annotations

import logging

import pytest

from dynabatch.common.net.log_limit import RateLimitedLog


def test_a_flood_of_refusals_logs_a_few_lines_and_one_summary_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("test.refusals"), lines=3, interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for i in range(5000):
            limited.refused("bad_field" if i % 2 else "malformed", f"message {i}", now=1000.0 + i * 0.001)
        limited.refused("version", "after the interval", now=1011.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [
        "rejected a message: message 0",
        "rejected a message: message 1",
        "rejected a message: message 2",
    ]
    assert lines[3] == (
        "rejected 4997 more messages in the last 10s (not logged one by one): bad_field x2499, malformed x2498"
    )
    assert lines[4] == "rejected a message: after the interval" and len(lines) == 5
