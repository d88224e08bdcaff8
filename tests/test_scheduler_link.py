"""`SchedulerLink` (common/net/scheduler_link.py), the registration every shard, worker and evaluator runs,
against a real scheduler process: one that starts after the link, answers, goes away or restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from dynabatch.common.config import job_from_dict
from dynabatch.common.net.scheduler_link import ASK_EVERY_S, BYE_ATTEMPT_S, BYE_TIMEOUT_S, SchedulerLink
from dynabatch.common.probe import PROBE_BATCH, fixed_cost
from dynabatch.common.wire.messages import Error, Hello, JobStatus, Role, Welcome, WorkerAssignment, WorkerHeartbeat
from dynabatch.worker.heartbeats import never_admitted
from harness import Cluster, wait_for

pytestmark = pytest.mark.slow

STARTUP_S = 60.0  # processes start slowly on a busy two-core machine
BYE_S = 1.0  # a short BYE timeout, so that giving up is quick to see
BYE_SLACK_S = 1.0  # what giving up may take beyond its timeout (one attempt's last wait)
JOB = ["--dataset", "synthetic", "--model", "flat:1000", "--epochs", "1000", "--liveness-timeout-s", "60"]


def _link(c: Cluster, name: str) -> SchedulerLink[WorkerHeartbeat, WorkerAssignment]:
    return SchedulerLink(c.ctx, c.scheduler_endpoint, "dynabatch", name, WorkerHeartbeat, WorkerAssignment)


def _register(
    link: SchedulerLink[WorkerHeartbeat, WorkerAssignment], on_wait: Callable[[], None] = lambda: None
) -> Welcome:
    """Register as a worker, giving up (and failing) after STARTUP_S."""
    deadline = time.monotonic() + STARTUP_S
    welcome = link.register(
        Hello(role=Role.WORKER, name=link.conn.sender), lambda: time.monotonic() > deadline, on_wait
    )
    assert welcome is not None, f"no WELCOME within {STARTUP_S:.0f}s"
    return welcome


def _beat(link: SchedulerLink[WorkerHeartbeat, WorkerAssignment]) -> WorkerAssignment | None:
    """One heartbeat, and the link's assignment once an answer has come (or a second has passed)."""
    link.heartbeat(WorkerHeartbeat())
    return link.wait(1.0)


def _lost(link: SchedulerLink[WorkerHeartbeat, WorkerAssignment]) -> bool:
    _beat(link)
    return link.lost


def _status(c: Cluster) -> JobStatus:
    return wait_for("the scheduler to answer STATUS", c.status, STARTUP_S)


def _workers(c: Cluster) -> set[str]:
    return set(_status(c).workers)


def _departed(c: Cluster) -> set[str]:
    return set(_status(c).departed)


def test_register_retries_until_a_scheduler_starts_and_registers_once(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    link = _link(c, "early")
    waits: list[float] = []

    def start_the_job_once_the_link_waits() -> None:
        if not waits:
            c.scheduler()
            c.shard()
        waits.append(time.monotonic())

    try:
        welcome = _register(link, start_the_job_once_the_link_waits)
        assert waits, "answered although nothing listened when it started"
        assert isinstance(welcome, Welcome) and link.id == welcome.id and len(welcome.shards) == 1
        assert _workers(c) == {welcome.id}, "HELLOs that queued while no scheduler listened registered once"
    finally:
        link.close()
        c.stop()


def test_bye_is_acknowledged_by_a_live_scheduler_and_given_up_quickly_without_one(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    leaving, staying = _link(c, "leaving"), _link(c, "staying")
    try:
        scheduler = c.scheduler()
        c.shard()
        _register(leaving)
        _register(staying)
        assert leaving.bye(BYE_S) is True
        assert leaving.id in _departed(c) and leaving.id not in _workers(c)
        scheduler.proc.kill()
        scheduler.proc.wait()
        started = time.monotonic()
        assert staying.bye() is False
        assert time.monotonic() - started < BYE_ATTEMPT_S + BYE_SLACK_S, (
            f"its connection closed: one attempt, not the whole {BYE_TIMEOUT_S:g} s"
        )
        assert _link(c, "never-registered").bye(BYE_S) is True, "nothing to take leave of"
    finally:
        leaving.close()
        staying.close()
        c.stop()


def test_a_restarted_scheduler_that_answers_unknown_sender_makes_the_link_lost(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    link = _link(c, "survivor")
    try:
        scheduler = c.scheduler()
        c.shard()
        first = _register(link)
        assert wait_for("an assignment", lambda: _beat(link), STARTUP_S) and not link.lost
        scheduler.proc.kill()
        scheduler.proc.wait()
        c.scheduler()  # on the same endpoint, knowing nobody
        wait_for("the new scheduler to answer a heartbeat with unknown_sender", lambda: _lost(link), STARTUP_S)
        again = _register(link)
        assert not link.lost and link.id == again.id
        assert link.poll() is None, "the first member's assignment (its allotment counts that member's samples) is gone"
        assert _workers(c) == {again.id}, f"registered anew (first as {first.id})"
    finally:
        link.close()
        c.stop()


def test_a_process_waiting_on_the_scheduler_asks_at_most_once_per_interval(tmp_path: Path) -> None:
    """An evaluator between evaluations or a worker awaiting its batch `ask`s in a loop: the scheduler answers
    each heartbeat at once, and the loop used to send the next one as soon as the answer came (hundreds a
    second). Counted by the scheduler itself (STATUS's decision count: the heartbeats it handled, the shard's own
    beats, one every `heartbeat_s`, among them)."""
    c = Cluster(tmp_path, JOB)
    link = _link(c, "waiting")
    try:
        c.scheduler()
        c.shard()
        job = job_from_dict(_register(link).config)
        before = _status(c).decision_s.count
        started = time.monotonic()
        answers = [link.ask(WorkerHeartbeat()) for _ in range(40)]
        took = time.monotonic() - started
        handled = _status(c).decision_s.count - before
        assert any(a is not None for a in answers), "the scheduler's assignment reached the waiting link"
        shard_beats = took / job.heartbeat_s + 1
        assert 1 <= handled <= took / ASK_EVERY_S + shard_beats + 2, f"{handled} heartbeats in {took:.2f} s"
    finally:
        link.close()
        c.stop()


def test_a_start_up_report_the_scheduler_refuses_is_refused_at_every_repeat_and_ends_the_workers_wait(
    tmp_path: Path,
) -> None:
    """A probe whose fixed cost is longer than its own step (a small batch stalled past the large one, before
    common/probe.py bounded it) is out of the scheduler's bounds: refused at every repeat, so the worker, which
    repeats it while it waits for a batch, was never admitted. The link keeps the refusal, and `never_admitted` says
    the worker must exit (worker/trainer.py); a report within bounds is answered and clears it."""
    c = Cluster(tmp_path, JOB)
    link = _link(c, "stalled")
    try:
        c.scheduler()
        c.shard()
        job = job_from_dict(_register(link).config)
        sps = 129_769.0
        stalled = WorkerHeartbeat(standalone_sps=sps, standalone_fixed_s=1.1 * job.max_batch / sps)
        for repeat in range(2):
            link.refused = None
            link.heartbeat(stalled)
            refused = wait_for(f"the answer to report {repeat}", lambda: link.wait(0.2) or link.refused, STARTUP_S)
            assert isinstance(refused, Error) and refused is link.refused and refused.code == "bad_field", refused
        problem = never_admitted(link.refused, stalled)
        assert problem is not None and "standalone_fixed_s" in problem and "never be admitted" in problem
        assert never_admitted(link.refused, replace(stalled, steps=3)) is None, "a report after steps may pass"
        probe_step = fixed_cost(16, 0.0087, PROBE_BATCH, PROBE_BATCH / sps)
        link.heartbeat(WorkerHeartbeat(standalone_sps=sps, standalone_fixed_s=probe_step))
        wait_for("an answer to the bounded probe", lambda: link.wait(0.2) is not None and link.refused is None, 30)
        assert _workers(c) == {link.id}
    finally:
        link.close()
        c.stop()
