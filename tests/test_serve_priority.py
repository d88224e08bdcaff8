"""A shard serves waiting workers in the order the scheduler ranks them, and in no order a worker claims.

A real scheduler and one real shard run as processes (asynchronous protocol: the
most transfer-bound worker is ranked first). The test registers two workers and
reports one step for each, one spending most of it on transfers ("wired") and one
computing ("computing"); the scheduler must rank "wired" first in STATUS and its
metrics, with each worker's plan and its reason, and tell the shard, whose own
gauge shows it. Then, on one connection that speaks for both (each bound on first
use), the computing worker parks a pull first (claiming in its envelope the first
rank, which the shard must ignore) and the wired one second; one push releases
both. The shard's replies on that connection come in the order it served them:
under `--chunk-schedule scheduled` the wired worker's chunks all come first, under
`fixed` (no ranks) the oldest pull's, as before.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

from dynabatch.common.config import job_from_dict
from dynabatch.common.net.transport import Connection
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Error, Params, Pull, Push, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from harness import Cluster, metric_value, wait_for

pytestmark = pytest.mark.slow

REPLY_S = 10.0
JOB = [
    "--dataset",
    "synthetic",
    "--model",
    "flat:10000",
    "--chunk-bytes",
    "8192",
    "--epochs",
    "1000",
    "--liveness-timeout-s",
    "60",
    "--protocol",
    "asgd",
    "--no-direction-check",
]
CLAIM_SEQ = 1 << 20  # the claiming pull's own seq, far from the connection's counter


def _step(transfer_s: float) -> WorkerHeartbeat:
    """One step's report of a 1 s step spending `transfer_s` of it moving 80 kB."""
    return WorkerHeartbeat(
        steps=1,
        samples=8,
        batch=8,
        times=StepTimes(step_s=1.0, compute_s=1.0 - transfer_s, pull_s=transfer_s / 2, push_s=transfer_s / 2),
        bytes=80_000,
        standalone_sps=1000.0,
    )


def _send_claiming(conn: Connection, body: Pull) -> int:
    """`body` in the connection's sender's name, its envelope claiming the first rank in every spelling a
    worker might try; returns its seq."""
    frames = encode(Message(body, [], [], conn.job, conn.sender, CLAIM_SEQ))
    envelope = msgpack.unpackb(frames[0], raw=False)
    envelope.update(serve_rank=0, serve_ranks={conn.sender: 0}, priority=-1)
    conn.sock.send_multipart([msgpack.packb(envelope, use_bin_type=True), *frames[1:]])
    return CLAIM_SEQ


def _chunks(conn: Connection, seq: int, count: int) -> list[ChunkMeta]:
    """The `count` chunk entries answering request `seq` (nothing else may come first)."""
    got: list[ChunkMeta] = []
    while len(got) < count:
        msg = conn.recv(REPLY_S)
        assert msg is not None and msg.seq == seq and isinstance(msg.body, Params), f"answered {msg}"
        got.extend(msg.chunks)
    return got


def _served_order(conn: Connection, seqs: dict[int, str], chunks: int) -> list[str]:
    """Who each PARAMS answering one of `seqs` was for, in the order they came, until each has `chunks`."""
    order: list[str] = []
    while any(order.count(w) < chunks for w in seqs.values()):
        msg = conn.recv(REPLY_S)
        assert msg is not None, f"the parked pulls were not answered in full: {order}"
        assert not isinstance(msg.body, Error), f"refused: {msg.body}"
        if isinstance(msg.body, Params) and msg.seq in seqs:
            order.append(seqs[msg.seq])
    return order


@pytest.mark.parametrize("schedule", ["scheduled", "fixed"])
def test_a_shard_serves_the_ranked_workers_waiting_pull_first_whatever_a_worker_claims(
    tmp_path: Path, schedule: str
) -> None:
    c = Cluster(tmp_path, [*JOB, "--chunk-schedule", schedule])
    try:
        scheduler = c.scheduler()
        shard = c.shard()
        links = {}
        for name in ("wired", "computing"):
            conn, welcome = c.join_as_worker()
            links[name] = (conn, welcome.id)
        for name, transfer_s in (("wired", 0.9), ("computing", 0.1)):
            conn, _ = links[name]
            conn.request(_step(transfer_s), REPLY_S)
        wid = {name: wid for name, (_, wid) in links.items()}
        status = c.wait_status(
            "both workers' steps reported", lambda s: all(s.workers[w].steps == 1 for w in wid.values())
        )
        shown = {name: status.workers[w] for name, w in wid.items()}
        job = job_from_dict(welcome.config)
        if schedule == "scheduled":
            assert shown["wired"].serve_rank == 0 and shown["computing"].serve_rank == 1, shown
            assert "Mbit/s" in shown["wired"].wire_reason, shown["wired"]
            assert shown["wired"].credit_bytes == job.max_inflight_bytes, "a 1 Mbit link gets no more than the job's"
            credit = shown["wired"].credit_bytes
            wait_for(
                "the scheduler's gauge of the plan",
                lambda: (
                    metric_value(scheduler.metrics(), "dynabatch_worker_credit_bytes", worker=wid["wired"]) == credit
                ),
                30,
            )
            wait_for(
                "the shard to take the scheduler's ranks",
                lambda: (
                    metric_value(  # an absent series reads 0
                        shard.metrics(), "dynabatch_ps_serve_rank", worker=wid["computing"]
                    )
                    == 1
                ),
                30,
            )
            assert metric_value(shard.metrics(), "dynabatch_ps_serve_rank", worker=wid["wired"]) == 0
        else:
            assert shown["wired"].serve_rank == -1 and shown["wired"].wire_reason == "fixed by the job's flags"

        total = sum(p.numel() for p in model_for_job(job).parameters())
        ids = sorted(make_layout(total, job.chunk_bytes, job.shards).sizes(0))
        both = c.client(welcome.shards[0], sender=wid["wired"])  # one connection speaking for both workers
        got = _chunks(both, both.send(Pull()), len(ids))  # binds "wired" to it, and tells the version
        version = max(m.version for m in got)
        both.sender = wid["computing"]
        parked = {_send_claiming(both, Pull(min_version=version + 1)): "computing"}
        both.sender = wid["wired"]
        parked[both.send(Pull(min_version=version + 1))] = "wired"
        # One connection keeps its order: once this later pull is answered, both earlier ones are parked.
        _chunks(both, both.send(Pull(ids=[ids[-1]])), 1)
        metas = [ChunkMeta(m.id, "float32", m.shape, m.version) for m in got]
        assert both.send(Push(samples=8), metas, [torch.full(m.shape, 0.5) for m in metas]) > 0
        order = _served_order(both, parked, len(ids))
        first = "wired" if schedule == "scheduled" else "computing"
        assert order == sorted(order, key=lambda w: w != first), f"served {order}, expected {first}'s pull first"
    finally:
        c.stop()
