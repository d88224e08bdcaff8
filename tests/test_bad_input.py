"""Garbage sent to a live shard and scheduler: ERROR or counted drop, process up, state unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.wire.frames import PROTOCOL_VERSION, ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Error, Pull, Push, PushAck, Welcome, WorkerHeartbeat
from harness import Cluster, Proc, free_port, metric_value, wait_for

pytestmark = pytest.mark.slow

JOB = ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--liveness-timeout-s", "30"]


class ShardUnderFire(Cluster):
    """The job, with what the fixture adds: the shard and scheduler processes, and a registered test worker's
    connections to both."""

    shard_port: int
    shard_proc: Proc
    sched_proc: Proc
    worker_conn: Connection
    welcome: Welcome
    shard_conn: Connection


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardUnderFire]:
    c = ShardUnderFire(tmp_path_factory.mktemp("bad_input"), JOB)
    c.scheduler()
    c.shard_port = free_port()
    c.shard_proc = c.shard(0, c.shard_port)
    c.sched_proc = c.procs[0]
    c.worker_conn, c.welcome = c.join_as_worker()
    c.shard_conn = c.client(c.welcome.shards[0], sender=c.welcome.id)
    model = _pull(c)
    metas, zeros = _good_push(c, model)

    def accepted() -> bool:
        try:
            return c.shard_conn.request(Push(samples=8), 5, metas, zeros) is not None
        except RemoteError:
            return False

    wait_for("the shard to learn that the test worker is live", accepted, 30)
    yield c
    c.stop()


def _pull(c: ShardUnderFire) -> Message[Any]:
    return c.shard_conn.request(Pull(), timeout_s=5)


def _good_push(c: ShardUnderFire, model: Message[Any], fill: float = 0.0) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    metas = [ChunkMeta(m.id, "float32", m.shape, m.version) for m in model.chunks]
    tensors = [torch.full(m.shape, fill) for m in model.chunks]
    return metas, tensors


def _raw(c: ShardUnderFire, endpoint: str, frames: list[bytes], timeout_s: float = 5.0) -> Message[Any] | None:
    """Send raw frames on a fresh DEALER and return the decoded answer (None if none came)."""
    conn = c.client(endpoint)
    try:
        conn.sock.send_multipart(frames)
        return conn.recv(timeout_s)
    finally:
        conn.close()


def _raw_on(conn: Connection, frames: list[bytes], timeout_s: float = 5.0) -> Message[Any] | None:
    """Send raw frames on `conn` (the test worker's own connection: the shard refuses its name from any other)
    and return the decoded answer (None if none came)."""
    conn.sock.send_multipart(frames)
    return conn.recv(timeout_s)


def _env(**fields: Any) -> bytes:
    base = {"v": PROTOCOL_VERSION, "job": "dynabatch", "sender": "w0", "seq": 5, "chunks": []}
    base.update(fields)
    packed: bytes = msgpack.packb(base)
    return packed


def _frames(
    body: Push, metas: list[ChunkMeta], tensors: list[torch.Tensor], sender: str, job: str = "dynabatch"
) -> list[bytes]:
    """A message as the bytes of its frames, sequence number 9."""
    return [bytes(f) for f in encode(Message(body, metas, tensors, job, sender, 9))]


def _cases(c: ShardUnderFire, model: Message[Any]) -> dict[str, tuple[list[bytes], str]]:
    metas, tensors = _good_push(c, model, 1.0)
    good = _frames(Push(samples=8), metas, tensors, c.welcome.id)
    nan = [t.clone() for t in tensors]
    nan[0][0] = float("nan")
    inf = [t.clone() for t in tensors]
    inf[-1][-1] = float("inf")
    unknown = [ChunkMeta(10_000, "float32", metas[0].shape, 0)] + metas[1:]
    sid = c.welcome.id
    return {
        "random bytes": ([bytes(range(256)) * 3], "malformed"),
        "truncated msgpack": ([good[0][: len(good[0]) // 2], *good[1:]], "malformed"),
        "missing tensor frame": (good[:-1], "frame_count"),
        "extra tensor frame": (good + [b"\x00" * 8], "frame_count"),
        "short tensor frame": (good[:-1] + [good[-1][:-4]], "frame_length"),
        "stale protocol version": ([_env(v=0, type="PULL")], "version"),
        "future protocol version": ([_env(v=PROTOCOL_VERSION + 1, type="PULL")], "version"),
        "unknown type": ([_env(type="EXPLODE")], "unknown_type"),
        "wrong field type": ([_env(type="PUSH", samples="many")], "bad_field"),
        "unknown chunk id": (_frames(Push(samples=8), unknown, tensors, sid), "unknown_chunk"),
        "NaN gradient": (_frames(Push(samples=8), metas, nan, sid), "non_finite"),
        "Inf gradient": (_frames(Push(samples=8), metas, inf, sid), "non_finite"),
        "wrong shape": (
            _frames(Push(samples=8), [ChunkMeta(metas[0].id, "float32", (3,), 0)], [torch.ones(3)], sid),
            "bad_shape",
        ),
        "unknown worker": (_frames(Push(samples=8), metas, tensors, "w999"), "unknown_sender"),
        "zero samples": (_frames(Push(samples=0), metas, tensors, sid), "bad_field"),
        "other job": (_frames(Push(samples=8), metas, tensors, sid, job="other"), "wrong_job"),
        "wrong message for a shard": ([_env(type="HELLO", role="worker")], "unexpected_type"),
    }


def test_every_bad_message_to_the_shard_gets_an_error_and_changes_nothing(cluster: ShardUnderFire) -> None:
    c = cluster
    before = _pull(c)
    cases = _cases(c, before)
    bad_before = c.shard_proc.metrics()
    for what, (frames, code) in cases.items():
        reply = _raw_on(c.shard_conn, frames)
        assert reply is not None, f"{what}: no answer"
        assert isinstance(reply.body, Error), f"{what}: answered {reply.type}"
        assert reply.body.code == code, f"{what}: code {reply.body.code} ({reply.body.text}), expected {code}"
        assert c.shard_proc.alive(), f"the shard died on {what}"
    after = _pull(c)
    assert after.body.version == before.body.version
    for a, b in zip(after.tensors, before.tensors, strict=True):
        assert torch.equal(a, b)
    text = c.shard_proc.metrics()
    for code in {code for _, code in cases.values()}:
        assert metric_value(text, "dynabatch_bad_messages_total", role="ps", reason=code) > metric_value(
            bad_before, "dynabatch_bad_messages_total", role="ps", reason=code
        ), code


def test_a_good_push_after_the_garbage_is_applied(cluster: ShardUnderFire) -> None:
    c = cluster
    before = _pull(c)
    metas, tensors = _good_push(c, before, 0.5)
    ack = c.shard_conn.request(Push(samples=8), 5, metas, tensors)
    assert isinstance(ack.body, PushAck) and ack.body.version == before.body.version + 1
    after = _pull(c)
    assert any(not torch.equal(a, b) for a, b in zip(after.tensors, before.tensors, strict=True))


def test_bad_messages_to_the_scheduler_are_refused_and_it_keeps_serving(cluster: ShardUnderFire) -> None:
    c = cluster
    status_before = c.status()
    frames_and_codes = [
        ([bytes(range(256))], "malformed"),
        ([_env(type="HEARTBEAT")[:-2]], "malformed"),
        ([_env(v=0, type="STATUS")], "version"),
        ([_env(type="NOPE")], "unknown_type"),
        ([_env(type="HEARTBEAT", sender="w999")], "unknown_sender"),
        # In a registered worker's name but from another connection: refused before any field is looked at
        # (the worker's own connection gets bad_field for these: tests/test_hostile_peers.py).
        ([_env(type="HEARTBEAT", sender=c.welcome.id, times={"step_s": float("nan")}, steps=1)], "bad_sender"),
        ([_env(type="HEARTBEAT", sender=c.welcome.id, samples=-5)], "bad_sender"),
        ([_env(type="HELLO", role="overlord")], "bad_field"),
        ([_env(type="STATUS", chunks=[{"id": 0, "dtype": "float32", "shape": [1]}]), b"\x00" * 4], "bad_chunk"),
        ([_env(type="STATUS", job="other")], "wrong_job"),
        ([_env(type="PULL")], "unexpected_type"),
    ]
    for frames, code in frames_and_codes:
        reply = _raw(c, c.scheduler_endpoint, frames)
        assert reply is not None and isinstance(reply.body, Error), f"{code}: no ERROR"
        assert reply.body.code == code, f"expected {code}, got {reply.body.code}: {reply.body.text}"
        assert c.sched_proc.alive()
    status_after = c.status()
    assert status_before is not None and status_after is not None
    assert status_after.workers.keys() == status_before.workers.keys()
    assert status_after.samples == status_before.samples
    text = c.sched_proc.metrics()
    assert metric_value(text, "dynabatch_bad_messages_total", role="scheduler", reason="malformed") >= 2
    reply = c.worker_conn.request(WorkerHeartbeat(standalone_sps=1000.0), timeout_s=5)
    assert reply.body.batch > 0


def _garbage_counted(c: ShardUnderFire) -> float:
    """Garbage the shard refused: unparsable, or (with more tensor frames than it has chunks) refused unparsed."""
    text = c.shard_proc.metrics()
    return sum(
        metric_value(text, "dynabatch_bad_messages_total", role="ps", reason=r) for r in ("malformed", "bad_chunk")
    )


def test_a_flood_of_garbage_is_counted_and_does_not_stop_the_shard(cluster: ShardUnderFire) -> None:
    c = cluster
    model_before = _pull(c)
    before = _garbage_counted(c)
    sock = c.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(c.welcome.shards[0])
    for i in range(2000):
        sock.send_multipart([bytes([0xC1, i % 256]) * (i % 97 + 1)] * (i % 4 + 1))

    def all_counted() -> bool:
        while sock.poll(0):
            sock.recv_multipart()
        return _garbage_counted(c) - before >= 2000

    wait_for("the shard to count 2000 garbage messages", all_counted, 60)
    sock.close()
    assert c.shard_proc.alive()
    model_after = _pull(c)  # it still serves, and the garbage changed nothing
    assert model_after.body.version == model_before.body.version
    assert all(torch.equal(a, b) for a, b in zip(model_after.tensors, model_before.tensors, strict=True))
