"""Whether a process hears its scheduler (common/net/scheduler_contact.py): a closed connection at once, a silent
scheduler after the silence allowed; /readyz follows, and an answer brings the process back."""

from __future__ import annotations

import logging

import pytest

from dynabatch.common.net.metrics import Health
from dynabatch.common.net.scheduler_contact import SchedulerContact


def test_a_silent_scheduler_is_lost_after_the_silence_allowed_and_back_at_its_next_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = Health()
    contact = SchedulerContact("tcp://s:5555", health, silence_s=2.0, now=0.0)
    with caplog.at_level(logging.INFO, logger="dynabatch.link"):
        contact.check(2.0, connection_closed=False)
        assert not health.scheduler_lost and not caplog.records, "within the silence allowed"
        contact.check(2.1, connection_closed=False)
        assert health.scheduler_lost and contact.lost_why == "no answer for 2.1 s"
        contact.check(5.0, connection_closed=True)
        assert len(caplog.records) == 1, "a loss is said once"
        contact.heard(6.0)
        assert not health.scheduler_lost and "answers again (lost: no answer for 2.1 s)" in caplog.records[-1].message


def test_a_closed_connection_is_a_lost_scheduler_at_once() -> None:
    health = Health()
    contact = SchedulerContact("tcp://s:5555", health, silence_s=10.0, now=0.0)
    contact.heard(1.0)
    contact.check(1.05, connection_closed=True)
    assert health.scheduler_lost and contact.lost_why == "its connection closed"
