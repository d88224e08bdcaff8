"""What a shard believes, on the wire and on disk: a PUSH taken once and within its sender's assignment, and only a
checkpoint that reads back good.

A real scheduler and a real shard (checkpointing) run as processes; the test is
the job's only worker and talks to the shard with a raw Connection.

- Replays: one PUSH, then the very same frames again on the same connection, as a
  peer that captured or repeats them would send them: the shard takes the first and
  refuses the copies (`replay`, counted). It then stops (SIGTERM: it checkpoints),
  starts again on the same port, and the replay is still refused: the restarted
  shard remembers the seq from its checkpoint. A new push (what an honest worker's
  retry is) is still taken.
- Assignment: a PUSH claiming more samples than the batch the scheduler assigned
  its sender (though within the job's --max-batch) is refused `bad_field`.
- Checkpoints: after a push (the checkpoint right after INIT becomes the previous
  copy when the shard checkpoints again at SIGTERM), bits are flipped in the newest
  checkpoint, as a failing disk would; the restarted shard refuses that copy with
  one line naming it, resumes the previous one (version 0), and serves the worker.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from dynabatch.cluster.launcher import Child
from dynabatch.cluster.ports import free_port
from dynabatch.common.config import job_from_dict
from dynabatch.common.net.transport import Connection
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Error, Params, Pull, Push, PushAck, Welcome, WorkerHeartbeat
from hang_guard import hang_guard_s
from harness import Cluster, Proc, metric_value, wait_for

pytestmark = pytest.mark.slow

REPLY_S = 10.0
JOB = [
    "--dataset",
    "synthetic",
    "--model",
    "flat:4000",
    "--chunk-bytes",
    "8192",
    "--epochs",
    "1000",
    "--liveness-timeout-s",
    "60",
]


def _pull(conn: Connection, ids: set[int]) -> dict[int, tuple[int, torch.Tensor]]:
    seq = conn.send(Pull())
    got: dict[int, tuple[int, torch.Tensor]] = {}
    deadline = time.monotonic() + REPLY_S
    while set(got) != ids:
        msg = conn.recv(max(0.0, deadline - time.monotonic()))
        assert msg is not None and msg.seq == seq and isinstance(msg.body, Params), msg
        got.update({m.id: (m.version, t.clone()) for m, t in zip(msg.chunks, msg.tensors, strict=True)})
    return got


def _answer(conn: Connection, seq: int) -> object:
    deadline = time.monotonic() + REPLY_S
    while (msg := conn.recv(max(0.0, deadline - time.monotonic()))) is not None:
        if msg.seq == seq:
            return msg.body
    raise AssertionError(f"no answer to request {seq}")


def _replays(shard: Proc) -> float:
    return metric_value(shard.metrics(), "dynabatch_bad_messages_total", role="ps", reason="replay")


def _bad_fields(shard: Proc) -> float:
    return metric_value(shard.metrics(), "dynabatch_bad_messages_total", role="ps", reason="bad_field")


def _gradient(chunks: dict[int, tuple[int, torch.Tensor]], fill: float) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    metas = [ChunkMeta(cid, "float32", tuple(t.shape), ver) for cid, (ver, t) in chunks.items()]
    return metas, [torch.full_like(t, fill) for _, t in chunks.values()]


def test_a_push_of_more_samples_than_its_sender_was_assigned_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [*JOB, "--global-batch", "32", "--max-batch", "1024"])
    try:
        c.scheduler()
        shard = c.shard(0)
        scheduler_conn, welcome = c.join_as_worker()
        batch = scheduler_conn.request(WorkerHeartbeat(standalone_sps=1000.0), timeout_s=REPLY_S).body.batch
        assert 0 < batch <= 32
        conn = c.client(welcome.shards[0], sender=welcome.id)
        ids = set(make_layout(_total(welcome), 8192, 1).sizes(0))
        before = _pull(conn, ids)
        counted = _bad_fields(shard)
        seq = conn.send(Push(samples=batch * 4), *_gradient(before, 0.01))
        reply = _answer(conn, seq)
        assert isinstance(reply, Error) and reply.code == "bad_field" and "assigned" in reply.text, reply
        assert _bad_fields(shard) == counted + 1
        assert all(v == before[cid][0] and torch.equal(t, before[cid][1]) for cid, (v, t) in _pull(conn, ids).items())
        seq = conn.send(Push(samples=batch), *_gradient(before, 0.01))
        assert isinstance(_answer(conn, seq), PushAck), "a push of the assigned batch is taken"
        conn.close()
    finally:
        c.stop()


def _total(welcome: Welcome) -> int:
    return sum(p.numel() for p in model_for_job(job_from_dict(welcome.config)).parameters())


def _checkpointing_shard(c: Cluster, tmp_path: Path) -> tuple[Child, Connection, Welcome, Connection, set[int]]:
    """A scheduler and a checkpointing shard on a fixed port, this test as their worker: (the shard, the worker's
    scheduler connection, its WELCOME, its connection to the shard, the shard's chunk ids)."""
    c.scheduler()
    shard = c.shard(0, free_port(), "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval-s", "3600")
    scheduler_conn, welcome = c.join_as_worker()
    job = job_from_dict(welcome.config)
    ids = set(make_layout(_total(welcome), job.chunk_bytes, job.shards).sizes(0))
    return shard, scheduler_conn, welcome, c.client(welcome.shards[0], sender=welcome.id), ids


def _stop_and_restart(c: Cluster, shard: Child, scheduler_conn: Connection) -> Child:
    """Start `shard` again (stopped already, or stopped here with SIGTERM: it checkpoints) and wait until it
    counts this test's worker live again."""
    if shard.alive():
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(timeout=hang_guard_s(60)) == 0
    shard = c.launcher.restart(shard)
    wait_for(
        "the restarted shard to count the worker live",
        lambda: (
            scheduler_conn.request(WorkerHeartbeat(standalone_sps=1000.0), timeout_s=2.0)
            and metric_value(shard.metrics(), "dynabatch_ps_live_workers", shard="0") == 1
        ),
        60,
    )
    return shard


def test_a_replayed_push_is_refused_counted_and_changes_nothing_also_after_a_restart(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    try:
        shard, scheduler_conn, welcome, conn, ids = _checkpointing_shard(c, tmp_path)
        job = job_from_dict(welcome.config)
        before = _pull(conn, ids)
        metas, tensors = _gradient(before, 0.01)
        seq = conn.send(Push(samples=8), metas, tensors)
        assert isinstance(_answer(conn, seq), PushAck)
        frames = [bytes(f) for f in encode(Message(Push(samples=8), metas, tensors, job.job, welcome.id, seq))]
        taken = _pull(conn, ids)
        assert all(ver == before[cid][0] + 1 for cid, (ver, _) in taken.items())

        for _ in range(3):
            conn.sock.send_multipart(frames)
            reply = _answer(conn, seq)
            assert isinstance(reply, Error) and reply.code == "replay", reply
        assert _replays(shard) == 3
        assert all(torch.equal(t, taken[cid][1]) and v == taken[cid][0] for cid, (v, t) in _pull(conn, ids).items())

        shard = _stop_and_restart(c, shard, scheduler_conn)
        conn.sock.send_multipart(frames)
        reply = _answer(conn, seq)
        assert isinstance(reply, Error) and reply.code == "replay", reply
        assert _replays(shard) == 1
        restored = _pull(conn, ids)
        assert all(torch.equal(t, taken[cid][1]) and v == taken[cid][0] for cid, (v, t) in restored.items())

        retry = conn.send(Push(samples=8), [ChunkMeta(m.id, m.dtype, m.shape, taken[m.id][0]) for m in metas], tensors)
        assert isinstance(_answer(conn, retry), PushAck), "a new push after the restart (a retry) is taken"
        conn.close()
    finally:
        c.stop()


def test_a_damaged_newest_checkpoint_is_refused_and_the_shard_resumes_the_previous_one(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    try:
        shard, scheduler_conn, _, conn, ids = _checkpointing_shard(c, tmp_path)
        initial = _pull(conn, ids)
        assert isinstance(_answer(conn, conn.send(Push(samples=8), *_gradient(initial, 0.01))), PushAck)
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(timeout=hang_guard_s(60)) == 0
        newest = tmp_path / "ckpt" / "shard-0.pt"
        data = bytearray(newest.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
        newest.write_bytes(bytes(data))
        shard = _stop_and_restart(c, shard, scheduler_conn)
        assert f"refused {newest}: its content does not match its checksum" in shard.log_since_start()
        resumed = _pull(conn, ids)
        for cid, (version, values) in resumed.items():
            assert version == 0 and torch.equal(values, initial[cid][1]), "the previous copy: the initial model"
        assert isinstance(_answer(conn, conn.send(Push(samples=8), *_gradient(resumed, 0.01))), PushAck)
        conn.close()
    finally:
        c.stop()
