"""A worker's shard clients against a shard process that dies: what it took fails at once, what follows waits for it.

ZeroMQ reconnects by itself, so without watching the link a worker learns of a
dead shard only when its request times out (30 s by default), although the
answer can no longer come. Real processes, killed with SIGKILL.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import zmq

from dynabatch.common.config import job_from_dict
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.worker.ps_client import ShardClients
from harness import Cluster, free_port, wait_for

TIMEOUT_S = 60.0  # a shard_lost answer comes at once; waiting this long would be the failure


def test_a_request_a_dying_shard_took_fails_at_once_and_one_sent_after_waits_for_its_return(tmp_path: Path) -> None:
    # A restarted shard takes its slot once the scheduler has declared the dead one gone, after the liveness
    # timeout: short, but not so short that this test client, which heartbeats only while it waits on the shard
    # (a worker has a thread for that), is dropped while it registers on a machine running two suites (2 s was).
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--liveness-timeout-s",
            "8",
            "--heartbeat-s",
            "0.2",
        ],
    )
    port, ckpt = free_port(), ("--checkpoint-dir", str(tmp_path / "ckpt"))
    try:
        c.scheduler()
        shard = c.shard(0, port, *ckpt)
        conn, welcome = c.join_as_worker()
        job = job_from_dict(welcome.config)
        total = sum(p.numel() for p in model_for_job(job).parameters())

        # While a request waits, the clients heartbeat (as a worker's do), so the scheduler keeps this worker.
        def heartbeat() -> None:
            conn.send(WorkerHeartbeat())

        shards = ShardClients(
            zmq.Context.instance(),
            welcome.shards,
            make_layout(total, job.chunk_bytes, job.shards),
            job.job,
            welcome.id,
            heartbeat,
            job.heartbeat_s,
        )
        try:
            assert shards.pull(None, TIMEOUT_S).version == 0

            # A pull the shard took (stopped, it never answers), then the shard dies. A second pull leaves after
            # the drop was reported: the first fails now, the second waits in ZeroMQ's queue for the shard's return.
            shard.proc.send_signal(signal.SIGSTOP)
            taken = shards.start_pull()
            shard.proc.kill()
            shard.proc.wait(10)
            wait_for("the drop to be reported", lambda: shards.conns[0].watch_drops().poll(0), TIMEOUT_S)
            after = shards.start_pull()
            with pytest.raises(RemoteError, match="shard_lost"):
                shards.wait(taken, TIMEOUT_S)
            c.shard(0, port, *ckpt)
            shards.wait(after, TIMEOUT_S)
            assert after.result().version == 0
        finally:
            shards.close()
    finally:
        c.stop()


def test_a_push_its_send_queue_cannot_take_waits_for_room_and_never_counts_as_acknowledged() -> None:
    # Nothing listens at the endpoint, so ZeroMQ queues the pushes and never passes them on: the queue fills as it
    # does for a worker whose credit holds more single-chunk pushes than the queue holds messages. A push that did
    # not go must not come back done with no acknowledgement (its round would wait for it until its timeout).
    layout = make_layout(512 * 256, 1024, 1)  # 512 chunks of 256 floats on one shard
    shards = ShardClients(zmq.Context.instance(), [f"tcp://127.0.0.1:{free_port()}"], layout, "job", "w")
    grads, versions = torch.zeros(layout.total), {c.id: 0 for c in layout.chunks}
    try:
        sent = []
        for chunk in layout.chunks:
            if not shards.can_push([chunk.id]):
                break
            sent.append(shards.start_push(grads, versions, 1, float("nan"), ids=[chunk.id]))
        assert 0 < len(sent) < len(layout.chunks)
        assert not any(p.done() for p in sent)
        with pytest.raises(TimeoutError, match="send queue to shard 0 is full"):
            shards.start_push(grads, versions, 1, float("nan"), ids=[layout.chunks[len(sent)].id])
    finally:
        shards.close()


def test_a_pull_its_send_queue_cannot_take_fails_at_once_instead_of_waiting_for_chunks_never_asked() -> None:
    # The same full queue as above: a pull that did not go must not hand back a request that waits (to the
    # step's timeout) for chunks no shard was asked for; it fails at once, which the worker retries.
    layout = make_layout(512 * 256, 1024, 1)
    shards = ShardClients(zmq.Context.instance(), [f"tcp://127.0.0.1:{free_port()}"], layout, "job", "w")
    grads, versions = torch.zeros(layout.total), {c.id: 0 for c in layout.chunks}
    try:
        for chunk in layout.chunks:
            if not shards.can_push([chunk.id]):
                break
            shards.start_push(grads, versions, 1, float("nan"), ids=[chunk.id])
        assert not shards.can_push([0])
        with pytest.raises(TimeoutError, match="send queue to shard 0 is full"):
            shards.start_pull()
        with pytest.raises(TimeoutError, match="send queue to shard 0 is full"):
            shards.start_pull(ids=[3])
    finally:
        shards.close()
