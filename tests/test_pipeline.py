"""Overlap: a worker's pipelined step against a real shard computes the plain gradient,
starts the first layer's forward before the last chunk has arrived, and pushes the
first gradient chunk before backward ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zmq

from dynabatch.common.config import JobConfig
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.tasks.data import load_dataset, make_batch
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import flat_grads, load_flat, make_layout
from dynabatch.task import cross_entropy
from dynabatch.worker.pipeline import Pipeline
from dynabatch.worker.ps_client import ShardClients
from harness import Cluster, wait_for

pytestmark = pytest.mark.slow

CHUNK = 20_000
# How long a request waits for the shard: nothing here is timed, and beside a second suite one pipelined step of the
# CNN took over 10 s.
TIMEOUT_S = 120.0


def test_pipelined_step_overlaps_and_pushes_the_plain_gradient(tmp_path: Path) -> None:
    flags = [
        "--dataset",
        "synthetic",
        "--model",
        "cnn",
        "--chunk-bytes",
        str(CHUNK),
        # The test's worker holds a batch but neither heartbeats nor reports a step after joining: it must outlive
        # the test (pytest's 300 s), or the scheduler drops it, as beside a second suite at 60 s, and the shard
        # refuses its pushes as an unknown sender's.
        "--liveness-timeout-s",
        "300",
        "--join-timeout-s",
        "300",
        "--weight-decay",
        "0",
        "--momentum",
        "0",
        "--lr",
        "0.05",
        "--global-batch",
        "192",
    ]
    c = Cluster(tmp_path, flags)
    try:
        c.scheduler()
        c.shard()
        _, welcome = c.join_as_worker()
        job = JobConfig(dataset="synthetic", model="cnn", chunk_bytes=CHUNK)
        model = model_for_job(job)
        layout = make_layout(sum(p.numel() for p in model.parameters()), CHUNK, 1)
        assert len(layout.chunks) > 10
        shards = ShardClients(zmq.Context.instance(), welcome.shards, layout, "dynabatch", welcome.id)
        x, y = make_batch(load_dataset("synthetic"), torch.arange(64), False)
        zeros = torch.zeros(layout.total)

        def known() -> bool:  # the shard learns of the new worker with its next heartbeat
            try:
                return bool(shards.push(zeros, shards.pull(None, TIMEOUT_S).chunk_versions, 64, 0.0, TIMEOUT_S))
            except RemoteError as exc:
                assert exc.code == "unknown_sender"
                return False

        wait_for("the shard to accept the test worker", known, 30)
        w0 = shards.pull(None, TIMEOUT_S).flat.clone()
        reference = model_for_job(job)
        load_flat(reference, w0)
        torch.autograd.backward(F.cross_entropy(reference(x), y))
        grad = flat_grads(reference)
        counted = sum(shards.staleness)
        pipeline = Pipeline(model, layout, shards, 1 << 20, TIMEOUT_S, cross_entropy)
        result = pipeline.step((x, y), None, 64)
        assert sum(shards.staleness) - counted == 1, "one step on one shard is one update, however many chunks"
        trace = result.trace
        assert set(trace.pushed_at) == {ch.id for ch in layout.chunks}
        assert min(trace.forward_start.values()) < max(trace.arrived_at.values()), "forward waited for the whole model"
        assert min(trace.pushed_at.values()) < trace.backward_end, "no gradient chunk left before backward ended"
        first_layer = min(trace.forward_start, key=trace.forward_start.__getitem__)
        assert first_layer == "0", "the input layer computes first"
        w1 = shards.pull(None, TIMEOUT_S).flat
        # asgd, one live worker, B = 192: the shard applies lr * (64 * 1 / 192) * g (no momentum or decay).
        torch.testing.assert_close(w0 - w1, 0.05 * 64 / 192 * grad, atol=1e-7, rtol=1e-4)

        # As the scheduler may plan it (WorkerAssignment.chunk_group, credit_bytes): four final chunks per PUSH within
        # a credit of two such pushes; the same gradient arrives, in a quarter of the messages, as one update.
        w1 = w1.clone()
        load_flat(reference, w1)
        reference.zero_grad()
        torch.autograd.backward(F.cross_entropy(reference(x), y))
        grad = flat_grads(reference)
        counted = sum(shards.staleness)
        trace = pipeline.step((x, y), None, 64, group=4, credit=8 * CHUNK).trace
        assert sum(shards.staleness) - counted == 1
        assert len(set(trace.pushed_at.values())) == -(-len(layout.chunks) // 4), "not four chunks per push"
        torch.testing.assert_close(w1 - shards.pull(None, TIMEOUT_S).flat, 0.05 * 64 / 192 * grad, atol=1e-7, rtol=1e-4)

        # The scheduled wire's pull ahead: the next step's pull leaves once this step's pushes have (the shard
        # sends each chunk as it reaches the version asked: here, as this step's push of it is applied), and the
        # next step, asking for those versions, takes that pull instead of sending its own.
        def after(versions: list[int]) -> list[int]:
            return [v + 1 for v in versions]

        result = pipeline.step((x, y), None, 64, ahead=after)
        assert pipeline.ahead is not None and pipeline.ahead[0] == after(result.pulled.shard_versions)
        asked, sent = pipeline.ahead
        result = pipeline.step((x, y), asked, 64)
        assert sent.done() and result.trace.arrived_at == sent.arrived_at, "the step sent a pull of its own"
        assert result.pulled.shard_versions == asked and pipeline.ahead is None
        w3 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # what the step computed on
        load_flat(reference, w3)
        reference.zero_grad()
        torch.autograd.backward(F.cross_entropy(reference(x), y))
        grad = flat_grads(reference)
        torch.testing.assert_close(w3 - shards.pull(None, TIMEOUT_S).flat, 0.05 * 64 / 192 * grad, atol=1e-7, rtol=1e-4)
        pipeline.step((x, y), None, 64, ahead=after)
        assert pipeline.step((x, y), None, 64).pulled.shard_versions, "a pull ahead of other versions is not taken"
    finally:
        c.stop()
