"""A hand-started cluster says what happens: the scheduler's log (progress, evaluations, its end), shards and
workers that lose the scheduler (log and /readyz), a restart that cannot resume, and keys that do not match."""

from __future__ import annotations

import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

from dynabatch.cluster.launcher import Child, keys_per_role
from dynabatch.common.net.curve import create_keys
from hang_guard import hang_guard_s
from harness import Cluster, metric_value, wait_for

# One shard, one worker idled by a slowdown (speed is not what is tested), an evaluator every second.
FLAGS = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--heartbeat-s",
    "0.2",
    "--liveness-timeout-s",
    "2",
    "--epochs",
    "1000",
    "--eval-interval-s",
    "1",
]
LOST = "lost the scheduler at {} (its connection closed)"


def _readyz(child: Child) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_scheduler_stopped_mid_job_is_logged_by_everyone_and_unready_until_it_returns(tmp_path: Path) -> None:
    c = Cluster(tmp_path, FLAGS)
    try:
        scheduler = c.scheduler("--log-every-s", "0.5")
        shard = c.shard(0)
        others = [shard, c.worker("a", "--slowdown", "4"), c.worker("eval", "--evaluator")]
        c.wait_status("training and an evaluation", lambda s: s.samples > 0 and s.eval_version is not None)
        log = wait_for(
            "a progress line with its speed and an evaluation in the scheduler's log",
            lambda: (
                text
                if len(
                    re.findall(
                        r"epoch \d+\.\d+/1000 \(\d+ samples, \d+ samples/s\), 1 worker\(s\) live",
                        text := scheduler.log_text(),
                    )
                )
                >= 1
                and re.search(r"evaluation of model v\d+ at epoch \d+\.\d+: loss \d", text)
                else None
            ),
        )
        assert "epoch" in log
        assert all(_readyz(child) == (200, "ready\n") for child in others)

        scheduler.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert scheduler.proc.wait(hang_guard_s(30)) == 0
        assert re.search(
            r"stopped by SIGINT at epoch \d+\.\d+, the job not finished; its progress is not saved "
            r"\(no --state-dir\)",
            scheduler.log_text(),
        )
        # The connection's close is seen at the next heartbeat: the reason is the close, not the silence allowed.
        lost = LOST.format(c.scheduler_endpoint)
        for child in others:

            def logged(child: Child = child) -> bool:
                return lost in child.log_text()

            wait_for(f"{child.name} to log the lost scheduler", logged)
            assert _readyz(child) == (503, "scheduler lost\n")

        scheduler = c.launcher.restart(scheduler)  # without --state-dir: it counts from zero
        wait_for("the shard ready again", lambda: _readyz(shard) == (200, "ready\n"))
        assert "answers again" in shard.log_text()
        wait_for(
            "the restarted scheduler to say how to resume",
            lambda: re.search(
                r"the shards hold a model at version \d+, so job 'dynabatch' was in progress, but this scheduler was "
                r"started without --state-dir: .* started with --state-dir DIR saves the job's progress there "
                r"and, started "
                r"again with the same DIR, resumes it",
                scheduler.log_since_start(),
            ),
        )
    finally:
        c.stop()


def test_a_worker_whose_keys_the_scheduler_refuses_says_so_and_counts_it(tmp_path: Path) -> None:
    """Keys of another `dynabatch keys`: the handshake fails at once, which the worker's one waiting line names
    (a scheduler that is not there gets "no answer"), and its /metrics counts."""
    create_keys(tmp_path / "job", force=False)
    create_keys(tmp_path / "other", force=False)
    c = Cluster(tmp_path, FLAGS, curve_dir=str(tmp_path / "job"))
    try:
        c.scheduler()
        (tmp_path / "mounts").mkdir()
        c.launcher.curve_dirs["stranger"] = keys_per_role(str(tmp_path / "other"), tmp_path / "mounts")["worker"]
        worker = c.launcher.start(
            "worker", "stranger", ["--scheduler", c.scheduler_endpoint, "--name", "stranger"], role="stranger"
        )
        line = wait_for("the worker's waiting line", lambda: re.search(r"waiting: .*", worker.log_text()))[0]
        assert "refuses this process's handshake" in line and "CURVE keys do not match" in line, line
        assert "no answer from the scheduler" not in worker.log_text()
        text = wait_for(
            "the failed handshakes counted",
            lambda: (
                t if metric_value(t := worker.metrics(), "dynabatch_scheduler_handshake_failures_total") > 0 else None
            ),
        )
        assert metric_value(text, "dynabatch_scheduler_handshake_failures_total", reason="other") > 0
    finally:
        c.stop()
