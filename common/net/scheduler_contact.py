"""Whether a shard, worker or evaluator still hears its scheduler, said in its log and on /readyz.

A process keeps its last assignment when the scheduler goes away (a shard serves,
a worker trains on), which is right for an outage of seconds; but a scheduler
stopped by hand left every other process training on with no word, and ready on
/readyz, while nothing counted their work. The link's own signs decide: its
connection closed (ZeroMQ's monitor: a stopped or killed scheduler closes it at
once), or no answer for the silence allowed (one that hangs). Either is logged at
the next heartbeat, and the process is not ready until an answer comes again.
"""

from __future__ import annotations

import logging

from dynabatch.common.net.metrics import Health

log = logging.getLogger("dynabatch.link")


class SchedulerContact:
    """When the scheduler last answered, and whether it is lost; a change is logged and shown on `health`."""

    def __init__(self, endpoint: str, health: Health, silence_s: float, now: float) -> None:
        self.endpoint = endpoint
        self.health = health
        self.silence_s = silence_s  # the longest a live scheduler leaves a heartbeat unanswered
        self.heard_at = now
        self.lost_why = ""

    def heard(self, now: float) -> None:
        """An answer arrived: the scheduler is there (again)."""
        self.heard_at = now
        if self.lost_why:
            log.info("the scheduler at %s answers again (lost: %s); ready", self.endpoint, self.lost_why)
            self.lost_why = ""
            self.health.scheduler_lost = False

    def check(self, now: float, connection_closed: bool) -> None:
        """After a heartbeat: is the scheduler lost (its connection closed, or silent too long)?"""
        if self.lost_why:
            return
        silent_s = now - self.heard_at
        if connection_closed:
            self.lost_why = "its connection closed"
        elif silent_s > self.silence_s:
            self.lost_why = f"no answer for {silent_s:.1f} s"
        else:
            return
        self.health.scheduler_lost = True
        log.warning(
            "lost the scheduler at %s (%s): going on with the last assignment, its work not counted, "
            "not ready on /readyz until the scheduler answers again",
            self.endpoint,
            self.lost_why,
        )
