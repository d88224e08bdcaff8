"""Jobs with real processes: workers die and join, shards restart from checkpoints."""

from __future__ import annotations

import json
import math
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dynabatch.common.net.transport import Connection
from dynabatch.common.tasks.models import build_model
from dynabatch.common.wire.frames import ChunkMeta, Message
from dynabatch.common.wire.messages import (
    Bye,
    ByeAck,
    Hello,
    JobStatus,
    Pull,
    Push,
    Role,
    Welcome,
    WorkerHeartbeat,
    WorkerStatus,
)
from dynabatch.common.wire.step_times import StepTimes
from hang_guard import hang_guard_s
from harness import Cluster, free_port, log_tails, run_job, wait_for

pytestmark = pytest.mark.slow

QUICK = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--liveness-timeout-s",
    "2",
    "--heartbeat-s",
    "0.2",
    "--global-batch",
    "96",
    "--batch-policy",
    "dynamic",
]  # shares that move with speed and membership


def _training(st: JobStatus, n: int) -> bool:
    return len(st.workers) == n and all(w.batch > 0 and w.steps > 3 for w in st.workers.values())


def test_a_killed_worker_share_moves_to_the_others_and_the_job_finishes(tmp_path: Path) -> None:
    # Six epochs last several times the drop (a 2 s liveness timeout, a few steps in) even under two suites.
    c = Cluster(tmp_path, QUICK + ["--epochs", "6"])
    try:
        scheduler = c.scheduler()
        c.shard()
        workers = {name: c.worker(name, "--slowdown", f) for name, f in (("a", "1"), ("b", "2"), ("victim", "2"))}
        st = c.wait_status("three workers training", lambda s: _training(s, 3))
        victim = next(wid for wid, w in st.workers.items() if w.name == "victim")
        workers["victim"].proc.send_signal(signal.SIGKILL)
        st = c.wait_status("the dead worker to be dropped", lambda s: victim not in s.workers, 20)
        assert victim in st.departed
        # The allocation (each decision's batches) gives the whole batch to the others; a worker holds a larger
        # batch once every shard has been told it may push that much (a shard heartbeat later), so what STATUS
        # shows it holding is at most its share.
        assert sum(st.decisions[-1].batches.values()) == 96 and victim not in st.decisions[-1].batches
        assert all(0 < w.batch <= st.decisions[-1].batches[wid] for wid, w in st.workers.items())
        assert all(w.batch > 0 for w in st.workers.values())
        # STATUS lists only the latest decisions, which speed updates may have pushed the drop out of; the log keeps it.
        assert re.search(
            rf"{victim} stopped sending heartbeats: none for [\d.]+ s, [\d.]+ s allowed .*; dropped",
            scheduler.log_text(),
        )
        final = c.wait_status("the job to finish without the dead worker", lambda s: s.finished, 120)
        assert final.epoch >= 6
        assert final.samples > st.samples, "the workers left trained on with the dead one's share"
    finally:
        c.stop()


def test_a_worker_past_max_workers_waits_as_a_spare_and_joins_once_a_member_leaves(tmp_path: Path) -> None:
    """Refused `full`, it asked again until a slot was free instead of ending in a traceback (and, under `dynabatch
    run` or Kubernetes, being started again and again)."""
    c = Cluster(tmp_path, QUICK + ["--epochs", "1000", "--max-workers", "1"])
    try:
        c.scheduler()
        c.shard()
        first = c.worker("first")
        c.wait_status("the first worker training", lambda s: _training(s, 1))
        spare = c.worker("spare")
        wait_for("the spare to say why it waits", lambda: "waiting: full: the job admits at most 1" in spare.log_text())
        assert spare.proc.poll() is None
        first.proc.send_signal(signal.SIGKILL)
        st = c.wait_status(
            "the spare training", lambda s: any(w.name == "spare" and w.steps for w in s.workers.values())
        )
        assert [w.name for w in st.workers.values()] == ["spare"]
    finally:
        c.stop()


def test_bye_is_acknowledged_after_everything_sent_before_it(tmp_path: Path) -> None:
    """A process that exits right after BYE_ACK has had its last heartbeat counted (ssgd workers stop by themselves).

    The test's worker has no pulse thread, so its liveness timeout is long: under two suites at once its model's
    upload outlasted QUICK's 2 s and the scheduler dropped it before the BYE this test is about."""
    c = Cluster(tmp_path, QUICK + ["--epochs", "1000", "--liveness-timeout-s", "60"])
    try:
        c.scheduler()
        c.shard()
        conn, welcome = c.join_as_worker()
        joined = c.status()
        assert joined is not None
        batch = joined.workers[welcome.id].batch
        assert (
            conn.send(
                WorkerHeartbeat(
                    steps=3,
                    samples=3 * batch,
                    batch=batch,
                    times=StepTimes(step_s=0.05, compute_s=0.05),
                    standalone_sps=1000.0,
                )
            )
            > 0
        )
        assert isinstance(conn.request(Bye(), timeout_s=5.0).body, ByeAck)
        st = c.status()
        assert st is not None
        assert welcome.id in st.departed and welcome.id not in st.workers
        assert st.samples == 3 * batch, "the heartbeat sent just before BYE was counted"
        assert isinstance(conn.request(Bye(), timeout_s=5.0).body, ByeAck), "a repeated BYE is acknowledged again"
        again = c.status()
        assert again is not None and again.samples == 3 * batch
        conn.close()
    finally:
        c.stop()


def test_hellos_that_arrive_together_register_one_worker(tmp_path: Path) -> None:
    """As when a worker retried HELLO while the scheduler was starting: one member, not ghosts a round waits for."""
    c = Cluster(tmp_path, QUICK + ["--epochs", "1000"])
    try:
        c.scheduler()
        c.shard()
        c.wait_status("the shard registered", lambda s: len(s.shards) == 1)
        conn = c.client(sender="eager")
        seqs = [conn.send(Hello(role=Role.WORKER, name="eager", instance="0123abcd")) for _ in range(3)]
        replies: dict[int, object] = {}
        while len(replies) < len(seqs):
            msg = conn.recv(10.0)
            assert msg is not None, f"only {len(replies)} of {len(seqs)} HELLOs were answered"
            replies[msg.seq] = msg.body
        welcomes = [r for r in replies.values() if isinstance(r, Welcome)]
        assert len(welcomes) == len(replies), replies
        assert len({r.id for r in welcomes}) == 1, "every HELLO got the same id"
        st = c.status()
        assert st is not None and list(st.workers) == [welcomes[0].id]
        conn.close()
    finally:
        c.stop()


def test_a_worker_that_joins_a_running_job_gets_a_share(tmp_path: Path) -> None:
    # The CNN, so that compute dominates a step and the speed model's split is stable.
    c = Cluster(tmp_path, QUICK + ["--epochs", "1000", "--model", "cnn"])
    try:
        c.scheduler()
        c.shard()
        c.worker("first", "--slowdown", "1")
        c.worker("second", "--slowdown", "2")
        before = c.wait_status("two workers training", lambda s: _training(s, 2))
        assert sum(before.decisions[-1].batches.values()) == 96
        c.worker("late", "--slowdown", "1")
        after = c.wait_status("the late worker training", lambda s: _training(s, 3), 60)
        late_id, late = next((wid, w) for wid, w in after.workers.items() if w.name == "late")
        assert late.batch > 0 and late.version > 0, "the late worker must pull the current model"
        # Each decision splits the whole batch; a worker holds a larger batch a shard heartbeat after it (the
        # shards bound its pushes by it first), so what STATUS shows is at most its share.
        share = after.decisions[-1].batches
        assert sum(share.values()) == 96 and set(share) == set(after.workers)
        assert all(0 < w.batch <= share[wid] for wid, w in after.workers.items())
        # The late worker's share comes out of the others' (each one's own share swings with its measured
        # speed on a loaded machine, so only their total is asserted).
        assert sum(share[wid] for wid in before.workers) == 96 - share[late_id] < 96
    finally:
        c.stop()


def test_a_restarted_shard_resumes_at_its_checkpointed_version(tmp_path: Path) -> None:
    c = Cluster(
        tmp_path, ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--liveness-timeout-s", "30"]
    )
    port = free_port()
    ckpt = tmp_path / "ckpt"
    try:
        c.scheduler()
        shard = c.shard(0, port, "--checkpoint-dir", str(ckpt), "--checkpoint-interval-s", "3600")
        conn, welcome = c.join_as_worker()
        data = c.client(welcome.shards[0], sender=welcome.id)
        model = data.request(Pull(), 10)
        metas = [ChunkMeta(m.id, "float32", m.shape, m.version) for m in model.chunks]
        grads = [torch.full(m.shape, 0.01) for m in model.chunks]
        wait_for("the shard to learn that the test worker is live", lambda: _try_push(data, metas, grads), 30)
        for _ in range(4):
            data.request(Push(samples=32), 10, metas, grads)
        saved = data.request(Pull(), 10)
        assert saved.body.version == 5
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(hang_guard_s(20)) == 0
        assert (ckpt / "shard-0.pt").exists()
        c.shard(0, port, "--checkpoint-dir", str(ckpt))

        def pulled_again() -> Message[Any] | None:
            try:
                return data.request(Pull(), 2)
            except TimeoutError:
                return None

        resumed = wait_for("the restarted shard to serve", pulled_again, 60)
        assert resumed.body.version == 5
        for a, b in zip(resumed.tensors, saved.tensors, strict=True):
            assert torch.equal(a, b)
        ack = wait_for("the restarted shard to accept pushes", lambda: _try_push(data, metas, grads), 30)
        assert ack.body.version == 6
    finally:
        c.stop()


def _try_push(conn: Connection, metas: list[ChunkMeta], grads: list[torch.Tensor]) -> Message[Any] | None:
    try:
        return conn.request(Push(samples=32), 2, metas, grads)
    except Exception:
        return None


def test_workers_keep_training_through_a_shard_restart(tmp_path: Path) -> None:
    # The job cannot end while its only shard is down, and no batch is handed out before both workers joined (under
    # two suites one worker once joined 2 s after the other, which had trained all of 2 epochs alone by then): three
    # epochs outlast the shard's stop, which follows the workers' first steps.
    c = Cluster(tmp_path, QUICK + ["--epochs", "3", "--min-workers", "2"])
    port = free_port()
    try:
        c.scheduler()
        shard = c.shard(0, port, "--checkpoint-dir", str(tmp_path / "ckpt"))
        # The default request timeout (30 s): a worker must not wait it out for the stopped shard's answers.
        workers = [c.worker("a"), c.worker("b", "--slowdown", "2")]
        st = c.wait_status("two workers training", lambda s: _training(s, 2))
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(hang_guard_s(20)) == 0
        c.shard(0, port, "--checkpoint-dir", str(tmp_path / "ckpt"))
        final = c.wait_status("the job to finish after the shard restart", lambda s: s.finished, 150)
        assert final.samples > st.samples
        logs = [w.log_text() for w in workers]
        assert not any("no complete reply from the shards" in log for log in logs), "a worker waited out its timeout"
        # A worker whose request was out when the shard stopped gave up on it at once; one that was computing
        # then sent its next request into ZeroMQ's queue, delivered once the shard was back.
        for log in logs:
            for failure in re.findall(r"step failed \((.*)\); retrying", log):
                assert failure.startswith(("shard_lost:", "unknown_sender:")), failure
    finally:
        c.stop()


def test_an_evaluation_skipped_for_a_shard_that_did_not_answer_is_tried_again_within_a_heartbeat(
    tmp_path: Path,
) -> None:
    """The evaluator's second pull times out on a stopped shard; once the shard goes on, the evaluation comes at
    once, not a whole evaluation interval later: within half of it, which only a missing retry takes."""
    eval_interval_s = 20
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--liveness-timeout-s",
            "600",
            "--heartbeat-s",
            "0.2",
            "--epochs",
            "1000",
            "--eval-interval-s",
            str(eval_interval_s),
        ],
    )
    try:
        c.scheduler()
        shard = c.shard()
        evaluator = c.worker("eval", "--evaluator", "--request-timeout-s", "1")  # it initialises the shard itself

        def evaluations() -> int:
            return evaluator.log_text().count("model v")

        wait_for("the first evaluation", evaluations, 120)
        shard.proc.send_signal(signal.SIGSTOP)
        wait_for(
            "the evaluator to skip an evaluation",
            lambda: "evaluation skipped" in evaluator.log_text(),
            2 * eval_interval_s,
        )
        shard.proc.send_signal(signal.SIGCONT)
        wait_for("an evaluation after the shard went on", lambda: evaluations() > 1, eval_interval_s / 2)
    finally:
        c.stop()


def test_a_worker_that_slows_down_mid_run_gets_a_smaller_batch(tmp_path: Path) -> None:
    # The emulation idles (F - 1) x the step's CPU time, and contention stretches only the wall time, so at a
    # contention of k (wall = k x CPU) the node is (k + F - 1) / k slower: 8x is 3.3x at k = 3 but 1.6x at k = 12,
    # where the share follows it to 40 of 96, never under half. So F is sized from the contention measured before
    # the job starts, past 2x for up to four times as much: F - 1 = 4k, at least 8x. From 4 s of training: four
    # steps take under a second even on a loaded machine (each further second of full speed costs both workers a
    # second of CNN steps).
    factor = max(8, math.ceil(1 + 4 * _contention()))
    c = Cluster(tmp_path, QUICK + ["--epochs", "1000", "--model", "cnn"])
    try:
        c.scheduler()
        c.shard()
        c.worker("steady", "--slowdown", "1")
        c.worker("tired", "--slowdown", f"1x,{factor}x@4s")

        def tired(st: JobStatus) -> WorkerStatus:
            return next(w for w in st.workers.values() if w.name == "tired")

        def steady(st: JobStatus) -> WorkerStatus:
            return next(w for w in st.workers.values() if w.name == "steady")

        # At equal speed the two hold about half the batch each, though the first steps' times are noisy where a
        # second suite competes for the cores (once the tired worker's share was 26, 31, 26 and 20 of 96 within
        # its first second). So the split is judged against the steady worker's at the same moment, not against a
        # snapshot of the noisy start: first both train with the tired worker holding at least a third of the
        # steady one's batch, well before the slowdown's 4 s of training even on a loaded machine.
        before = c.wait_status(
            "both training at full speed, the tired worker with at least a third of the steady one's batch",
            lambda s: _training(s, 2) and tired(s).steps > 3 and 3 * tired(s).batch >= steady(s).batch,
        )
        # The slowdown starts after 4 s of its training; then the speed model needs a window of slowed steps, each
        # F x the step's CPU time (at least 2x slower in wall time, above), so the tired worker's batch falls under
        # half the steady one's. (Its step time need not grow: under asgd the batch follows the compute time the
        # worker reports from its first slowed step.)
        after = c.wait_status(
            "the slowed worker's batch to fall under half the steady one's",
            lambda s: 2 * tired(s).batch < steady(s).batch,
            max(60.0, 4.0 + 8 * 50 * tired(before).times.step_s),
        )
        assert sum(after.decisions[-1].batches.values()) == 96, "the steady worker's share takes the rest"
        assert any(d.reason == "speed update" for d in after.decisions)
    finally:
        c.stop()


def _contention(batch: int = 48) -> float:
    """Wall seconds per CPU second of a CNN training step at `batch` in this process now (the median of 5): how
    much the machine's load stretches a worker's compute, which the CPU-time slowdown emulation does not."""
    return statistics.median(wall / max(cpu, 1e-9) for wall, cpu in _cnn_steps(batch))


def _cnn_cpu_s(batch: int) -> float:
    """CPU seconds of one training step of the synthetic CNN at `batch` in this process now (the fastest of 5),
    which a slowdown multiplies."""
    return min(cpu for _, cpu in _cnn_steps(batch))


def _cnn_steps(batch: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of 5 training steps of the synthetic CNN at `batch`, on one thread as a worker
    process trains."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("cnn", (1, 28, 28), 10, seed=0)
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        times = []
        for _ in range(5):
            wall, cpu = time.perf_counter(), time.thread_time()
            torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
            times.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return times
    finally:
        torch.set_num_threads(before)


def test_a_local_round_longer_than_the_liveness_timeout_drops_nobody(tmp_path: Path) -> None:
    """A round of H local steps is longer than the liveness timeout, and nobody is dropped: workers heartbeat from
    a thread whatever their main thread does (worker/pulse.py), not once per round.

    The liveness timeout is 10 of the slowest node's steps at a batch of 96, by this machine's CPU time for one
    (at least 3 s). A round is 48 steps of 96 (auto's policy starts fixed), about 3.8 times the timeout on a quiet
    machine, and a loaded machine stretches the rounds' wall time, not the timeout (a timeout from wall time,
    measured at a busy moment, once came out as long as a round). The job's epochs are one round of 48 steps of 96
    for each worker (2 x 48 x 96 of 12,000 samples): a job trains the epochs it is asked for, so half an epoch would
    be one round of 63. The check at the end fails the test if a round did not outlast the timeout.
    """
    STEPS, BATCH = 48, 96
    LIVENESS_S = max(3.0, 10 * 6 * _cnn_cpu_s(96))
    run, _ = run_job(
        tmp_path,
        "r",
        "--dataset",
        "synthetic",
        "--model",
        "cnn",
        "--protocol",
        "local",
        "--local-steps",
        str(STEPS),
        "--workers",
        "2",
        "--slowdowns",
        "4",
        "6",
        "--epochs",
        "0.768",
        "--liveness-timeout-s",
        str(LIVENESS_S),
        "--heartbeat-s",
        "0.2",
        "--no-evaluator",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"]
    timeouts = [d for d in summary["decisions"] if d["reason"] == "heartbeat timeout"]
    assert not timeouts, f"{timeouts}{log_tails(run)}"
    assert sorted(w["name"] for w in summary["workers"].values()) == ["worker0", "worker1"], "nobody had to rejoin"
    trained = [w["samples"] for w in summary["workers"].values()]
    assert trained == [STEPS * BATCH] * 2, f"each trained one round, its last report before it left: {trained}"
    steps_s = [w["samples"] / w["standalone_samples_per_s"] for w in summary["workers"].values()]
    assert min(steps_s) > LIVENESS_S, (
        f"a round's steps ({steps_s} s) must outlast the liveness timeout to test anything"
    )


def test_a_worker_silent_for_steps_past_the_liveness_timeout_stays_live_and_a_ghost_expires(tmp_path: Path) -> None:
    """An honest worker whose main thread is silent for longer than the liveness timeout, while it probes its
    speed and in its first step (which the scheduler cannot yet excuse by a step time it measured), stays the
    one live member and its samples count; a HELLO never followed by a heartbeat
    is dropped within a few liveness timeouts (the join timeout is 120 s).

    The slowdown's idle time is as silent as compute; its factor makes a step at the job's batch (96, the
    whole global batch) three liveness timeouts long as this machine runs the CNN now, and a step must be
    measured past the timeout to test anything. One probe step, so that start-up is one slow step.
    """
    LIVENESS_S = 1.5
    factor = max(2, math.ceil(3 * LIVENESS_S / _cnn_cpu_s(96)))
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "cnn",
            "--global-batch",
            "96",
            "--epochs",
            "1000",
            "--liveness-timeout-s",
            str(LIVENESS_S),
            "--join-timeout-s",
            "120",
            "--heartbeat-s",
            "0.1",
        ],
    )
    try:
        scheduler = c.scheduler()
        c.shard()
        c.wait_status("the shard registered", lambda s: len(s.shards) == 1)
        c.worker("slow", "--slowdown", str(factor), "--probe-steps", "1")
        conn = c.client(sender="ghost")
        ghost = conn.request(Hello(role=Role.WORKER, name="ghost", instance="feedc0de"), timeout_s=10.0).body.id
        c.wait_status("the ghost to be dropped", lambda s: ghost in s.departed, 10 * LIVENESS_S)
        st = c.wait_status(
            "the slow worker's first step",
            lambda s: any(w.name == "slow" and w.steps >= 1 for w in s.workers.values()),
            120,
        )
        [(wid, slow)] = st.workers.items()
        assert slow.name == "slow" and list(st.departed) == [ghost], (
            f"nobody but the ghost was dropped: {list(st.departed)}"
        )
        assert slow.times.compute_s > LIVENESS_S, (
            f"a step's silent compute ({slow.times.compute_s:.2f} s) must outlast the liveness timeout to test anything"
        )
        assert st.samples == slow.samples == slow.steps * 96, "every sample it trained counts"
        assert scheduler.log_text().count("stopped sending heartbeats: none for") == 1
        conn.close()
    finally:
        c.stop()
