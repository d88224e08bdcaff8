"""The scheduler's socket loop (scheduler/server.py) on the wire.

A real scheduler (and, where workers must be admitted, a real shard) runs as a
process; the test speaks to it with a raw `Connection` and the messages of
common/wire/messages.py: HELLO is answered WELCOME once the job can take workers,
STATUS is answered, and a message from a stranger, for another job or of a type
the scheduler does not take is answered ERROR with the code naming its fault,
counted on /metrics, and changes nothing.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.verified_files import read_verified
from dynabatch.common.wire.eval_bounds import MAX_EVAL_METRICS
from dynabatch.common.wire.frames import chunk_meta
from dynabatch.common.wire.messages import (
    EvalReport,
    Hello,
    Pull,
    PushAck,
    Role,
    ShardHeartbeat,
    StatusReply,
    StatusRequest,
    Welcome,
    WorkerHeartbeat,
    WorkerStatus,
)
from dynabatch.scheduler.saved_progress import progress_path
from harness import Cluster, Proc, metric_value, wait_for

pytestmark = pytest.mark.slow

REPLY_S = 10.0  # a reply on a busy two-core machine
RETRY_S = 2.0  # one try while waiting for a process to start
JOB = ["--dataset", "synthetic", "--model", "flat:1000", "--epochs", "1000", "--liveness-timeout-s", "60"]


def _workers(c: Cluster) -> dict[str, WorkerStatus]:
    """The live workers in the scheduler's STATUS, by id."""
    st = c.status()
    assert st is not None, "the scheduler did not answer STATUS"
    return st.workers


def _refusals(scheduler: Proc, code: str) -> float:
    return metric_value(scheduler.metrics(), "dynabatch_bad_messages_total", role="scheduler", reason=code)


def _hello(c: Cluster, instance: str, timeout_s: float = REPLY_S) -> Welcome:
    conn = c.client(sender="hello-test")
    try:
        welcome = conn.request(Hello(role=Role.WORKER, name="hello-test", instance=instance), timeout_s).body
        assert isinstance(welcome, Welcome), welcome
        return welcome
    finally:
        conn.close()


class SchedulerJob(Cluster):
    """The job, with its scheduler's process (set by the fixture)."""

    sched: Proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerJob]:
    c = SchedulerJob(tmp_path_factory.mktemp("scheduler_server"), JOB)
    c.sched = c.scheduler()
    c.shard()
    yield c
    c.stop()


def test_hello_is_refused_until_every_shard_is_there_then_welcomed_once(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    try:
        scheduler = c.scheduler()
        instance = secrets.token_hex(8)
        refused = wait_for("the scheduler to answer HELLO", lambda: _refused_hello(c, instance), 60)
        assert refused.code == "not_ready", refused
        assert _refusals(scheduler, "not_ready") >= 1
        c.shard()
        welcome = wait_for("a WELCOME once the shard has registered", lambda: _welcomed(c, instance), 60)
        assert isinstance(welcome, Welcome) and welcome.config["job"] == "dynabatch" and len(welcome.shards) == 1
        assert _hello(c, instance).id == welcome.id, "a repeated HELLO of one process gets the same WELCOME"
        other = _hello(c, secrets.token_hex(8))
        assert other.id != welcome.id
        assert _workers(c).keys() == {welcome.id, other.id}
    finally:
        c.stop()


def test_work_a_shard_lost_is_saved_before_the_scheduler_answers_anything_else(tmp_path: Path) -> None:
    """A drop in a shard's version (a restart from an older checkpoint) is lost work to train again; the scheduler
    writes the count to --state-dir before the next message, not at its once-a-second save, so a scheduler killed
    right after answering resumes with it (its shards train on through the outage, past the saved version, and
    would never be caught behind it again)."""
    c = Cluster(tmp_path, JOB)
    saved = progress_path(str(tmp_path / "state"), "dynabatch")
    conn = c.client(sender="ps-test")
    try:
        c.scheduler("--state-dir", str(saved.parent))
        hello = Hello(role=Role.SHARD, endpoint="tcp://127.0.0.1:1", shard_index=0, instance=secrets.token_hex(8))
        conn.sender = wait_for("the scheduler to welcome a shard", lambda: _welcome_or_none(conn, hello), 60).id
        conn.request(ShardHeartbeat(version=100, samples=4800), REPLY_S)
        wait_for("the scheduler's first save", saved.exists, 30)
        conn.request(ShardHeartbeat(version=40, samples=1920), REPLY_S)  # the shard came back from an older checkpoint
        st = c.status()
        assert st is not None and st.lost_versions == 60, st
        assert json.loads(read_verified(saved))["lost_versions"] == 60, "the loss was answered before it was saved"
    finally:
        conn.close()
        c.stop()


def _welcome_or_none(conn: Connection, hello: Hello) -> Welcome | None:
    try:
        welcome = conn.request(hello, RETRY_S).body
    except TimeoutError:  # not listening yet
        return None
    assert isinstance(welcome, Welcome), welcome
    return welcome


def _refused_hello(c: Cluster, instance: str) -> RemoteError | None:
    try:
        _hello(c, instance, RETRY_S)
    except RemoteError as exc:
        return exc
    except TimeoutError:  # not listening yet
        return None
    raise AssertionError("welcomed before any shard registered")


def _welcomed(c: Cluster, instance: str) -> Welcome | None:
    try:
        return _hello(c, instance, RETRY_S)
    except RemoteError as exc:
        assert exc.code == "not_ready", exc
        return None


@pytest.mark.parametrize(
    "sender, job, body, code",
    [
        ("w999", "dynabatch", WorkerHeartbeat(), "unknown_sender"),
        ("test", "other-job", StatusRequest(), "wrong_job"),
        ("test", "dynabatch", Pull(), "unexpected_type"),
        ("test", "dynabatch", PushAck(version=1), "unexpected_type"),
    ],
    ids=["heartbeat from a stranger", "another job", "a shard's request", "a shard's answer"],
)
def test_a_refused_message_is_answered_counted_and_changes_nothing(
    cluster: SchedulerJob, sender: str, job: str, body: object, code: str
) -> None:
    c = cluster
    wait_for("the scheduler to answer STATUS", c.status, 60)
    workers = _workers(c)
    counted = _refusals(c.sched, code)
    conn = c.client(sender=sender, job=job)
    try:
        with pytest.raises(RemoteError) as refused:
            conn.request(body, REPLY_S)
    finally:
        conn.close()
    assert refused.value.code == code, refused.value
    assert _refusals(c.sched, code) == counted + 1
    assert c.sched.alive()
    assert _workers(c) == workers


def test_status_answers_with_the_registered_workers(cluster: SchedulerJob) -> None:
    c = cluster
    worker, welcome = c.join_as_worker()
    asking = c.client()
    try:
        assert isinstance(asking.request(StatusRequest(), REPLY_S).body, StatusReply)
        assert welcome.id in _workers(c)
    finally:
        asking.close()
        worker.close()


def _eval_series(scheduler: Proc) -> dict[str, float]:
    """dynabatch_eval_metric's series on the scheduler's /metrics, by name."""
    return {
        name: float(value)
        for name, value in re.findall(r'^dynabatch_eval_metric\{name="([^"]*)"\} (\S+)$', scheduler.metrics(), re.M)
    }


def test_eval_metrics_are_exported_by_name_with_their_names_capped_for_the_whole_job(cluster: SchedulerJob) -> None:
    """The series holds the latest evaluation's metrics only; past MAX_EVAL_METRICS names in all, a new name is
    dropped with one warning, and an EVAL beyond the bounds is refused and counted."""
    c = cluster
    wait_for("the scheduler to answer STATUS", c.status, 60)
    conn = c.client(sender="eval-test")  # a member speaks from the connection it registered from
    try:
        welcome = conn.request(
            Hello(role=Role.EVALUATOR, name="eval-test", instance=secrets.token_hex(8)), REPLY_S
        ).body
        conn.sender = welcome.id
        counted = _refusals(c.sched, "bad_field")
        too_many = {f"n{i}": 0.5 for i in range(MAX_EVAL_METRICS + 1)}
        with pytest.raises(RemoteError, match="EVAL.metrics") as refused:
            conn.request(EvalReport(version=1, test_loss=0.5, test_acc=0.5, metrics=too_many), REPLY_S)
        assert refused.value.code == "bad_field" and _refusals(c.sched, "bad_field") == counted + 1

        first = {f"m{i:02d}": float(i) for i in range(MAX_EVAL_METRICS)}
        conn.send(EvalReport(version=1, test_loss=0.5, test_acc=0.5, metrics=first))
        wait_for("every metric of the first evaluation", lambda: _eval_series(c.sched) == first, 30)
        for mark, extra in ((2.0, "extra"), (3.0, "another")):  # version 1 again: no shard is past it in this job
            metrics = {"m00": mark, extra: 1.0}
            conn.send(EvalReport(version=1, test_loss=0.5, test_acc=0.5, metrics=metrics))

            def marked(m: float = mark) -> bool:
                return _eval_series(c.sched).get("m00") == m

            wait_for(f"the evaluation marked {mark}", marked, 30)
            assert _eval_series(c.sched) == {"m00": mark}, "only the latest evaluation's admitted names"
        assert c.sched.log_text().count("dynabatch_eval_metric already holds") == 1
        assert "'extra'" in c.sched.log_text()
    finally:
        conn.close()


def test_a_message_with_tensor_frames_is_refused_unparsed_and_the_scheduler_never_loads_torch(
    cluster: SchedulerJob,
) -> None:
    """Nothing sent to the scheduler carries a tensor: frames are refused (`bad_chunk`) right after the
    envelope, never turned into tensors, so a flood of frames costs a length check and torch stays unloaded."""
    c = cluster
    wait_for("the scheduler to answer STATUS", c.status, 60)
    counted = _refusals(c.sched, "bad_chunk")
    conn = c.client(sender="frames-test")
    try:
        chunk = torch.ones(1 << 16)
        with pytest.raises(RemoteError) as refused:
            conn.request(WorkerHeartbeat(), REPLY_S, chunks=[chunk_meta(0, chunk)], tensors=[chunk])
    finally:
        conn.close()
    assert refused.value.code == "bad_chunk", refused.value
    assert _refusals(c.sched, "bad_chunk") == counted + 1
    maps = Path(f"/proc/{c.sched.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the scheduler loaded torch"
