"""Divergence with real processes: a shard guards its parameters, the job rolls back and recovers, or ends with
a clear error; and a job that trains nothing ends instead of waiting for its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from dynabatch.cluster.launcher import child_env, command_line
from dynabatch.common.config import job_from_dict
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ChunkMeta
from dynabatch.common.wire.messages import Pull, Push, PushAck
from harness import Cluster, metric_value, wait_for

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parent / "tasks"
REPLY_S = 10.0
# A small flat model in several chunks; the test itself is the only worker, so nothing moves the model but it.
# The gradient bound (--gradient-bound) would clip the huge pushes that blow the model up here: these tests are
# about what happens once a model has blown up, so they run without it.
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
    "--max-rollbacks",
    "1",
    "--gradient-bound",
    "0",
]

Chunks = dict[int, tuple[int, torch.Tensor]]


def _pull(conn: Connection, ids: set[int]) -> Chunks:
    seq = conn.send(Pull())
    got: Chunks = {}
    while set(got) != ids:
        msg = conn.recv(REPLY_S)
        assert msg is not None and msg.seq == seq, f"chunks {sorted(ids - set(got))} never came"
        got.update({m.id: (m.version, t.clone()) for m, t in zip(msg.chunks, msg.tensors, strict=True)})
    return got


def _push(conn: Connection, pulled: Chunks, fill: float) -> None:
    metas = [ChunkMeta(cid, "float32", tuple(t.shape), ver) for cid, (ver, t) in pulled.items()]
    ack = conn.request(Push(samples=8), REPLY_S, metas, [torch.full_like(t, fill) for _, t in pulled.values()])
    assert isinstance(ack.body, PushAck) and ack.body.applied, ack.body


def test_a_shard_whose_model_blows_up_keeps_its_good_checkpoint_is_rolled_back_and_then_ends_the_job(
    tmp_path: Path,
) -> None:
    c = Cluster(tmp_path, JOB)
    try:
        scheduler = c.scheduler()
        shard = c.shard(0, None, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval-s", "0.2")
        _, welcome = c.join_as_worker()
        job = job_from_dict(welcome.config)
        total = sum(p.numel() for p in model_for_job(job).parameters())
        ids = set(make_layout(total, job.chunk_bytes, job.shards).sizes(0))
        conn = c.client(welcome.shards[0], sender=welcome.id)

        _push(conn, _pull(conn, ids), 0.5)
        c.wait_status("a checkpoint of the healthy model at version 1", lambda s: s.shards["0"].good_version == 1)
        good = _pull(conn, ids)
        assert {ver for ver, _ in good.values()} == {1}

        _push(conn, good, 1e4)  # finite, and within the push's bounds: the model's norm jumps a thousandfold
        st = c.wait_status(
            "the rollback to version 1",
            lambda s: s.rollbacks and s.shards["0"].version == 1 and not s.shards["0"].model_problem,
        )
        rollback = st.rollbacks[0]
        assert rollback.cause.startswith("ps0: parameter norm") and "running level" in rollback.cause, rollback
        assert (rollback.number, rollback.versions, rollback.lr_factor, st.lr_factor) == (1, {"0": 1}, 0.5, 0.5)
        assert st.lost_versions == 1, "the update thrown away is counted back into the job"
        restored = _pull(conn, ids)
        for cid, (ver, values) in restored.items():
            assert ver == 1 and torch.equal(values, good[cid][1]), f"chunk {cid} is not the checkpoint's"
        for declared, code in ((2, "rolled_back"), (3, "bad_field")):  # thrown away, or never reached
            metas = [ChunkMeta(cid, "float32", tuple(t.shape), declared) for cid, (_, t) in restored.items()]
            with pytest.raises(RemoteError) as refused:
                conn.request(Push(samples=8), REPLY_S, metas, [torch.zeros_like(t) for _, t in restored.values()])
            assert refused.value.code == code, refused.value
        # The scheduler copies its state into the series every EXPORT_EVERY_S: its STATUS above may be newer.
        wait_for(
            "the scheduler's series to count the rollback",
            lambda: (
                (
                    metric_value(scheduler.metrics(), "dynabatch_rollbacks_total"),
                    metric_value(scheduler.metrics(), "dynabatch_job_lr_factor"),
                )
                == (1, 0.5)
            ),
            30,
        )
        assert metric_value(shard.metrics(), "dynabatch_ps_rollbacks_total", shard="0") == 1
        assert metric_value(shard.metrics(), "dynabatch_ps_model_healthy", shard="0") == 1

        _push(conn, restored, 1e37)  # the norm overflows: --max-rollbacks 1 is spent, so the job gives up
        st = c.wait_status("the job to fail", lambda s: bool(s.failed))
        assert "ps0: parameter norm overflows" in st.failed and "--max-rollbacks 1" in st.failed, st.failed
        assert st.stopping and len(st.rollbacks) == 1
        wait_for(
            "the shard to refuse a checkpoint of the wrecked model",
            lambda: metric_value(shard.metrics(), "dynabatch_ps_checkpoints_refused_total", shard="0") >= 1,
        )
        after = c.status()
        assert after is not None
        assert after.shards["0"].model_problem and after.shards["0"].good_version == 1, after.shards["0"]
        assert metric_value(shard.metrics(), "dynabatch_ps_model_healthy", shard="0") == 0
    finally:
        c.stop()


def _run(out: Path, name: str, *flags: str, timeout_s: float = 300) -> tuple[subprocess.CompletedProcess[str], Path]:
    cmd = command_line(
        "run", ["--out", str(out), "--name", name, "--timeout-s", str(timeout_s - 30), "--no-plots", *flags]
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env()), out / name


@pytest.mark.parametrize("protocol", ["asgd", "ssgd"])
def test_a_job_that_keeps_diverging_rolls_back_halving_its_step_then_ends_with_an_error(
    tmp_path: Path, protocol: str
) -> None:
    """`--lr 1e4` blows the MLP up at every step size the rollbacks try. Cut into four chunks, its asgd steps
    run pipelined (a NaN loss pushes nothing); ssgd's pulls wait for rounds the rollback takes away. No evaluator:
    the workers' losses and the shard's guard tell the divergence, and an evaluator was a sixth of the test's CPU."""
    done, run = _run(
        tmp_path,
        "r",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--lr",
        "1e4",
        "--checkpoint-interval-s",
        "1",
        "--protocol",
        protocol,
        "--chunk-bytes",
        "262144",
        "--no-evaluator",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("diverged at epoch")]
    assert [line.rsplit(", ", 1)[1] for line in lines] == ["lr x0.5", "lr x0.25", "lr x0.125"], done.stderr
    assert all("rolled back to version 0" in line for line in lines), lines  # no later model was ever healthy
    assert "job failed: diverged" in done.stderr and "--max-rollbacks 3" in done.stderr, done.stderr
    assert "timeout" not in done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert "--max-rollbacks 3" in summary["failed"], summary["failed"]
    assert not summary["finished"] and "finished=False" in done.stdout, "a script reading finished sees the failure"
    assert [r["lr_factor"] for r in summary["rollbacks"]] == [0.5, 0.25, 0.125]
    assert summary["lr_factor"] == 0.125
    assert "FAILED: diverged" in done.stdout


def test_a_job_that_diverges_once_from_a_transient_cause_rolls_back_and_finishes(tmp_path: Path) -> None:
    """Each worker's loss is a million times too large for three steps (tests/tasks/spike.py): the job rolls
    back past them (once per worker at most), trains on at a smaller step, and learns. Without the gradient bound,
    which would clip the spike's pushes before they blow the model up."""
    done, run = _run(
        tmp_path,
        "r",
        "--task",
        f"{TASKS / 'spike.py'}:task",
        "--workers",
        "2",
        "--gradient-bound",
        "0",
        "--slowdowns",
        "1",
        "1",
        "--epochs",
        "3",
        "--global-batch",
        "96",
        "--checkpoint-interval-s",
        "0.3",
        "--eval-interval-s",
        "600",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] is None and summary["finished"] and summary["final_eval"]
    assert 1 <= len(summary["rollbacks"]) <= 2, summary["rollbacks"]
    assert summary["lr_factor"] == 0.5 ** len(summary["rollbacks"])
    assert summary["final_test_acc"] > 0.8, summary["final_test_acc"]  # blobs; chance is 25%
    said = [line for line in done.stderr.splitlines() if line.startswith("diverged at epoch")]
    assert len(said) == len(summary["rollbacks"]) and "rolled back to version" in said[0], done.stderr
    assert said[0].endswith("lr x0.5") and f"rolled back {len(said)} time(s)" in done.stdout, done.stdout


def test_a_job_that_trains_nothing_ends_with_an_error_instead_of_running_on(tmp_path: Path) -> None:
    """The shard is frozen: every worker's step fails while its heartbeat keeps it live. The job fails once
    no sample was trained for its bound (here the join timeout, 3 s: more than 50 of the workers' steps)."""
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--join-timeout-s",
            "3",
            "--liveness-timeout-s",
            "60",
        ],
    )
    try:
        c.scheduler()
        shard = c.shard(0)
        c.worker("a")
        c.wait_status("training", lambda s: s.samples > 0)
        os.kill(shard.proc.pid, signal.SIGSTOP)
        try:
            st = c.wait_status("the job to fail for lack of progress", lambda s: bool(s.failed))
        finally:
            os.kill(shard.proc.pid, signal.SIGCONT)
        assert "no sample trained for" in st.failed and "1 worker(s) were live" in st.failed, st.failed
        assert st.stopping
    finally:
        c.stop()
