"""Peers that decode cleanly and lie, against a live scheduler: refused, counted, and nothing changes.

Each attack comes from a plain ZeroMQ connection of its own, as an attacker on the
job's port (or any holder of a worker key under CURVE) would send it. The
scheduler binds every member to the connection that registered it and checks
every number against what is physically possible.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.wire.messages import Bye, EvalReport, Hello, Role, Welcome, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from harness import Cluster, metric_value

pytestmark = pytest.mark.slow

MAX_WORKERS = 8
HELLO_BURST = 24  # registrations from 127.0.0.1, where every member of this job comes from; barely refilled


class VictimsJob(Cluster):
    """The job, with the registered worker whose state the attacks must not change (set by the fixture)."""

    victim: Connection
    welcome: Welcome


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VictimsJob]:
    c = VictimsJob(
        tmp_path_factory.mktemp("hostile"),
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--liveness-timeout-s",
            "60",
            "--max-workers",
            str(MAX_WORKERS),
            "--hello-burst",
            str(HELLO_BURST),
            "--hello-rate-per-s",
            "0.001",
        ],
    )
    c.scheduler()
    c.shard(0)
    c.victim, c.welcome = c.join_as_worker()
    yield c
    c.stop()


def _refused(job: VictimsJob, sender: str, body: object, code: str) -> None:
    """Send `body` in `sender`'s name from a connection of its own; it must be refused with `code`, and counted."""
    before = _count(job, code)
    attacker = job.client(sender=sender)
    try:
        with pytest.raises(RemoteError) as refused:
            attacker.request(body, timeout_s=10)
        assert refused.value.code == code, refused.value
    finally:
        attacker.close()
    assert _count(job, code) == before + 1


def _count(job: VictimsJob, code: str) -> float:
    return metric_value(job.procs[0].metrics(), "dynabatch_bad_messages_total", role="scheduler", reason=code)


def _victim_state(job: VictimsJob) -> tuple[int, int]:
    status = job.status()
    assert status is not None, "the scheduler does not answer"
    victim = status.workers[job.welcome.id]
    return victim.samples, victim.steps


def test_a_heartbeat_or_bye_in_another_workers_name_is_refused_and_the_worker_is_untouched(job: VictimsJob) -> None:
    before = _victim_state(job)
    _refused(
        job,
        job.welcome.id,
        WorkerHeartbeat(steps=10**6, samples=10**9, batch=32, times=StepTimes(step_s=0.1), standalone_sps=1.0),
        "bad_sender",
    )
    _refused(job, job.welcome.id, Bye(), "bad_sender")
    status = job.status()
    assert status is not None
    assert job.welcome.id in status.workers and _victim_state(job) == before


def test_a_workers_own_impossible_numbers_are_refused_naming_the_field(job: VictimsJob) -> None:
    victim = job.victim
    status = job.status()
    assert status is not None
    epoch = status.epoch
    for hb, field in (
        (
            WorkerHeartbeat(steps=1, samples=10**12, batch=32, times=StepTimes(step_s=0.1), standalone_sps=1000.0),
            "samples",
        ),
        (WorkerHeartbeat(standalone_sps=5e-324), "standalone_sps"),
        (
            WorkerHeartbeat(steps=1, samples=32, batch=32, times=StepTimes(step_s=float("inf")), standalone_sps=1000.0),
            "times.step_s",
        ),
    ):
        with pytest.raises(RemoteError, match=f"HEARTBEAT.{field}") as refused:
            victim.request(hb, timeout_s=10)
        assert refused.value.code == "bad_field"
    status = job.status()
    assert status is not None
    assert status.epoch == epoch and job.procs[0].alive()


def test_only_an_evaluator_reports_evaluations_and_only_of_versions_that_can_exist(job: VictimsJob) -> None:
    _refused(job, job.welcome.id, EvalReport(version=1, test_loss=0.1, test_acc=0.999), "bad_sender")
    evaluator = job.client(sender="evaluator")
    try:
        welcome = evaluator.request(Hello(role=Role.EVALUATOR, name="liar", instance="liar"), timeout_s=10).body
        evaluator.sender = welcome.id
        with pytest.raises(RemoteError, match="EVAL.version"):
            evaluator.request(EvalReport(version=2**62, test_loss=0.1, test_acc=0.999), timeout_s=10)
    finally:
        evaluator.close()
    status = job.status()
    assert status is not None
    assert status.test_acc is None, "no evaluation was taken"


def test_an_evaluation_outside_what_a_fraction_can_be_or_not_finite_is_refused_and_never_shown(job: VictimsJob) -> None:
    evaluator = job.client(sender="evaluator")
    try:
        evaluator.sender = evaluator.request(
            Hello(role=Role.EVALUATOR, name="boaster", instance="boaster"), timeout_s=10
        ).body.id
        nan, inf = float("nan"), float("inf")
        for report, field in (
            (EvalReport(version=0, test_loss=0.1, test_acc=7.0), "test_acc"),
            (EvalReport(version=0, test_loss=0.1, test_acc=-1.0), "test_acc"),
            (EvalReport(version=0, test_loss=nan, test_acc=0.5), "test_loss"),
            (EvalReport(version=0, test_loss=0.1, test_acc=inf), "test_acc"),
            (EvalReport(version=0, test_loss=0.1, test_acc=0.5, metrics={"loss": nan}), "metrics\\['loss'\\]"),
        ):
            before = _count(job, "bad_field")
            with pytest.raises(RemoteError, match=f"EVAL.{field}") as refused:
                evaluator.request(report, timeout_s=10)
            assert refused.value.code == "bad_field" and _count(job, "bad_field") == before + 1
        evaluator.request(Bye(), timeout_s=10)
    finally:
        evaluator.close()
    status = job.status()
    assert status is not None
    assert status.test_acc is None, "no evaluation was taken"


def test_a_flood_of_hellos_registers_at_most_max_workers_and_counts_none_in_n(job: VictimsJob) -> None:
    flood = job.client(sender="flood")
    ghosts, full = [], 0
    for i in range(3 * MAX_WORKERS):
        try:
            reply = flood.request(Hello(role=Role.WORKER, name=f"ghost{i}", instance=f"ghost{i}"), timeout_s=10)
            ghosts.append(reply.body.id)
        except RemoteError as exc:
            assert exc.code == "full", exc
            full += 1
    assert len(ghosts) <= MAX_WORKERS and full >= 2 * MAX_WORKERS
    assignment = job.victim.request(WorkerHeartbeat(standalone_sps=1000.0), timeout_s=10).body
    assert assignment.lr_scale == 1.0, "n counts the workers holding a batch, never the ghosts"
    shard = job.procs[1]
    assert metric_value(shard.metrics(), "dynabatch_ps_live_workers", shard="0") == 1, (
        "the shards (whose rounds wait on every live worker) are never told of a member that never reported"
    )
    for ghost in ghosts:  # the ghosts leave, so that the job is not full for the tests after this one
        flood.sender = ghost
        flood.request(Bye(), timeout_s=10)
    flood.close()


def test_a_second_shard_cannot_take_a_live_shards_slot(job: VictimsJob) -> None:
    _refused(
        job,
        "impostor",
        Hello(role=Role.SHARD, endpoint="tcp://127.0.0.1:1", shard_index=0, instance="impostor"),
        "slot_taken",
    )
    status = job.status()
    assert status is not None
    assert status.shards["0"].endpoint == job.welcome.shards[0], "workers that join are sent the real shard"


def test_one_source_churning_registrations_meets_the_hello_rate_and_a_rejoin_never_does(job: VictimsJob) -> None:
    """HELLO + BYE from one address until its bucket is empty: refused `hello_rate` (counted), nothing changes,
    while a HELLO repeated by a registered process (a re-join) is still welcomed."""
    churn = job.client(sender="churn")
    status = job.status()
    assert status is not None
    before = status.workers.keys()
    try:
        for i in range(HELLO_BURST + 1):
            try:
                welcome = churn.request(
                    Hello(role=Role.WORKER, name=f"churn{i}", instance=f"churn{i}"), timeout_s=10
                ).body
            except RemoteError as exc:
                assert exc.code == "hello_rate", exc
                break
            churn.sender = welcome.id
            churn.request(Bye(), timeout_s=10)
        else:
            raise AssertionError(f"{HELLO_BURST + 1} registrations from one source were all admitted")
        assert 0 < i < HELLO_BURST, "the earlier members of this job (all from 127.0.0.1) spent part of the burst"
    finally:
        churn.close()
    status = job.status()
    assert status is not None
    assert _count(job, "hello_rate") == 1 and status.workers.keys() == before
    rejoin = job.client(sender="liar")
    try:
        again = rejoin.request(Hello(role=Role.EVALUATOR, name="liar", instance="liar"), timeout_s=10).body
        assert isinstance(again, Welcome) and again.id.startswith("eval")
    finally:
        rejoin.close()
