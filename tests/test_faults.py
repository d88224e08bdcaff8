"""Fault tests: shards and the scheduler killed with SIGKILL mid-run and started again with the same arguments.

One job meets all three faults in turn (a shard killed before its first interval
checkpoint, another after a checkpoint of a trained model, then the scheduler) and must still finish, with
its epoch count continuous across the scheduler's restart, every lost version
logged and trained again, and test accuracy no lower than the same job's run
without faults by more than the test set resolves. Restarts go through `Launcher.restart`, as `dynabatch run` does.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dynabatch.cluster.launcher import Child
from dynabatch.cluster.main import JobRun
from dynabatch.cluster.options import RunOptions
from dynabatch.common.config import JobConfig
from dynabatch.common.tasks.data import load_dataset
from dynabatch.common.verified_files import DamagedFile, read_verified
from dynabatch.common.wire.messages import JobStatus
from hang_guard import hang_guard_s
from harness import Cluster, free_port, wait_for

EPOCHS = 3.0
# Each shard's half of the MLP (470 KB) travels in two chunks of at most 256 KB: a restarted shard serves a model of
# several chunks. (In 64 KB chunks, eight each, the two jobs cost 46 s of CPU instead of 29, with the same accuracy.)
FLAGS = [
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
    "--shards",
    "2",
    "--chunk-bytes",
    "262144",
    "--epochs",
    str(EPOCHS),
    "--await-final-eval",
]
# No shard writes an interval checkpoint: a shard's checkpoints are the one right after initialisation and the one it
# writes as it stops, which the test brings about (SIGTERM) where it needs one.
NEVER_S = 3600.0
# Shard 1 is killed this many versions past the checkpoint it resumes.
KILL_LEAD = 5
# The faulty job's accuracy may fall short of the clean job's by this many standard errors of their difference (a
# one-sided test at about 0.1%).
SHORTFALL_SE = 3.0


class Job:
    """A job of two shards, two workers and an evaluator; the scheduler saves its progress, shards checkpoint."""

    def __init__(self, tmp: Path) -> None:
        self.c = Cluster(tmp, FLAGS)
        self.started = time.monotonic()
        self.wall_s = 0.0  # from the start to the end of the job, once _final has seen it
        self.scheduler = self.c.scheduler("--state-dir", str(tmp / "state"))
        self.shards = [
            self.c.shard(i, free_port(), "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-interval-s", str(NEVER_S))
            for i in range(2)
        ]
        self.processes = [self.c.worker(name) for name in ("a", "b")]  # on the default request timeout, 30 s
        self.processes.append(self.c.launcher.start_worker("eval", [], evaluator=True))

    def progress(self, what: str, predicate: Callable[[JobStatus], object], timeout_s: float = 90) -> JobStatus:
        return self.c.wait_status(what, predicate, timeout_s)

    @staticmethod
    def kill(child: Child) -> float:
        """SIGKILL `child`; when it was dead."""
        child.proc.kill()
        child.proc.wait(10)
        return time.monotonic()

    def kill_and_restart(self, child: Child) -> tuple[Child, float]:
        """SIGKILL `child`, start it again with the same arguments; (the new child, when it was killed)."""
        killed = self.kill(child)
        return self.c.launcher.restart(child), killed

    @staticmethod
    def stop(child: Child) -> None:
        """SIGTERM `child` (a shard checkpoints as it stops) and wait for it to exit cleanly."""
        child.proc.terminate()
        assert child.proc.wait(hang_guard_s(60)) == 0, child.log_tail(25)


def _training(s: JobStatus) -> JobStatus:
    """`s`, a STATUS of the job while it trains; one of a finished job (which lists no shards or workers) fails the
    test at once: every fault must land mid-run."""
    assert not s.finished, "the job finished before the test was done with its faults"
    return s


def _version(s: JobStatus, shard: int) -> int:
    """Shard `shard`'s version in the STATUS of a job that trains (-1 while its slot is empty: a restart)."""
    held = _training(s).shards.get(str(shard))
    return -1 if held is None else held.version


def _versions_checkpointed(child: Child) -> list[int]:
    return [int(v) for v in re.findall(r"checkpoint at version (\d+) written", child.log_text())]


def _epoch(saved: dict[str, Any]) -> float:
    """The epoch a progress file of the scheduler holds (the samples the model holds, over the training set)."""
    epoch: float = (saved["samples"] - saved["lost_samples"]) / saved["train_size"]
    return epoch


def _saved_epoch(path: Path) -> float:
    """The epoch of the scheduler's progress file now (0 while it is being replaced: a rename at a time)."""
    try:
        return _epoch(json.loads(read_verified(path)))
    except (OSError, DamagedFile):
        return 0.0


def _accuracy_se(a: float, b: float) -> float:
    """The standard error of the difference of two accuracies `a`, `b` measured on the synthetic test set: each a
    binomial proportion over its examples."""
    n = len(load_dataset("synthetic").test_y)
    return math.sqrt((a * (1 - a) + b * (1 - b)) / n)


def _final(job: Job) -> JobStatus:
    st = job.progress("the job to finish", lambda s: s.finished, 120)
    job.wall_s = time.monotonic() - job.started
    return st


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobStatus, float]:
    """The same job without faults: the accuracy and duration to compare with."""
    job = Job(tmp_path_factory.mktemp("clean"))
    try:
        return _final(job), job.wall_s
    finally:
        job.c.stop()


@pytest.mark.slow
def test_a_job_survives_shard_and_scheduler_kills_and_trains_what_was_lost(
    tmp_path: Path, clean: tuple[JobStatus, float]
) -> None:
    baseline, clean_s = clean
    job = Job(tmp_path)
    try:
        target = EPOCHS * 12000
        # Shard 0, before its first interval checkpoint: it comes back at its initial model (version 0).
        st = job.progress("10% of the job", lambda s: s.epoch >= 0.1 * EPOCHS and s.shards["0"].version > 0)
        assert _versions_checkpointed(job.shards[0]) == [0], "only the checkpoint right after initialisation"
        lost0 = st.shards["0"].version
        job.shards[0], killed = job.kill_and_restart(job.shards[0])
        st = job.progress("shard 0 to serve again", lambda s: s.lost_versions >= lost0 and s.shards["0"].version > 0)
        shard_recovery_s = time.monotonic() - killed
        assert st.lost_versions >= lost0

        # Shard 1, after a checkpoint of a trained model: stopped with SIGTERM it checkpoints where it is and comes
        # back there, losing nothing; killed KILL_LEAD versions later, it comes back at that checkpoint.
        before = st.lost_versions
        job.stop(job.shards[1])
        stopped_at = _versions_checkpointed(job.shards[1])[-1]
        assert stopped_at > 0, "shard 1 checkpointed its trained model as it stopped"
        job.shards[1] = job.c.launcher.restart(job.shards[1])
        st = job.progress(
            "shard 1 past the checkpoint it stopped with", lambda s: _version(s, 1) > stopped_at + KILL_LEAD
        )
        assert re.search(f"resumed from .* at version {stopped_at} ", job.shards[1].log_since_start())
        assert st.lost_versions == before, "a shard stopped with SIGTERM loses no work"
        job.shards[1], _ = job.kill_and_restart(job.shards[1])
        earlier = job.progress("shard 1's loss counted", lambda s: s.lost_versions > before)
        assert re.search(f"resumed from .* at version {stopped_at} ", job.shards[1].log_since_start())
        assert KILL_LEAD < earlier.lost_versions - before <= earlier.shards["1"].version + earlier.lost_versions

        # The scheduler, mid-run: it resumes the job's progress from its last save, the outage counted as job time.
        st = job.progress("half the job", lambda s: _training(s).epoch >= 0.5 * EPOCHS, 120)
        progress_file = tmp_path / "state" / "scheduler-dynabatch.json"
        wait_for(
            "the scheduler to save its progress past shard 1's loss",
            lambda: _saved_epoch(progress_file) > earlier.epoch,
        )
        killed = job.kill(job.scheduler)
        saved = json.loads(read_verified(progress_file))
        job.scheduler = job.c.launcher.restart(job.scheduler)
        resumed = job.progress(
            "both workers training under the restarted scheduler",
            lambda s: len(s.workers) == 2 and all(w.steps > 0 for w in s.workers.values()),
        )
        scheduler_recovery_s = time.monotonic() - killed
        assert not set(resumed.workers) & set(st.workers), "a rejoining worker never gets an id known before"
        assert resumed.t >= st.t + scheduler_recovery_s * 0.5, "scheduler time goes on through the outage"
        assert resumed.epoch >= _epoch(saved), "the epoch count goes on from the saved one"
        assert resumed.lost_samples == st.lost_samples and resumed.eval_version is not None

        final = _final(job)
        log = job.scheduler.log_text()
        for shard in (0, 1):
            assert re.search(rf"ps{shard} came back \d+ versions behind .*: \d+ samples lost, counted back", log), log
        assert "resumed job" in log
        for child in job.processes:
            assert "no complete reply from the shards" not in child.log_text(), f"{child.name} waited out a timeout"
        assert final.samples - final.lost_samples >= target, "every lost sample was trained again"
        assert final.lost_samples > 0
        # Recovery costs no accuracy that the test set can resolve: the two jobs' orders of asgd updates alone move
        # their final accuracies by about one point (0.9425 to 0.954 in five clean runs beside two busy loops), as
        # the binomial spread of an accuracy on 2,000 examples says.
        assert final.test_acc is not None and baseline.test_acc is not None
        assert baseline.test_acc - final.test_acc <= SHORTFALL_SE * _accuracy_se(final.test_acc, baseline.test_acc), (
            final.test_acc,
            baseline.test_acc,
        )
        print(
            f"\nclean {clean_s:.1f}s acc {baseline.test_acc:.4f}; faulty {job.wall_s:.1f}s acc {final.test_acc:.4f}; "
            f"lost {final.lost_versions} versions, {final.lost_samples} samples made up; recovery: shard "
            f"{shard_recovery_s:.1f}s, scheduler {scheduler_recovery_s:.1f}s"
        )
    finally:
        job.c.stop()


def test_dynabatch_run_restarts_an_exited_server_a_bounded_number_of_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = JobRun(RunOptions(restarts=2), JobConfig(), [], tmp_path, "", None)
    run.launcher.spawn("ps0", "ps", [sys.executable, "-c", "import sys; sys.exit(3)"])
    run.launcher.spawn("worker0", "worker", [sys.executable, "-c", "pass"])
    for attempt in (1, 2):
        wait_for("the shard to exit", lambda: run.launcher.failed("ps"), 30)
        assert run._supervise()
        assert run.launcher.children[0].restarts == attempt and len(run.launcher.children) == 2
    wait_for("the shard to exit again", lambda: run.launcher.failed("ps"), 30)
    assert not run._supervise(), "restarts are exhausted: the run fails"
    err = capsys.readouterr().err
    assert "ps0 exited with code 3; starting it again (1 of 2)" in err
    assert "ps0 exited with code 3 after 2 restart(s) (--restarts 2)" in err
    assert (tmp_path / "logs" / "ps0.log").read_text().count("restarted by the launcher") == 2
    assert not run.launcher.failed("worker"), "a worker that ends without an error is not restarted"
