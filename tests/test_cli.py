"""The command line refuses bad flags and missing data with a clear message, before starting anything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.flags import add_flags, from_args
from harness import Cluster, wait_for


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynabatch.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--workers", "0"], "--workers"),
        (["run", "--protocol", "nope"], "--protocol"),
        (["run", "--slowdowns", "1", "2"], "--slowdowns: 2 given for 3 workers"),
        (["run", "--slowdowns", "fast", "1", "1"], "cannot read 'fast'"),
        (["run", "--min-batch", "64", "--max-batch", "8"], "--min-batch 64 is larger"),
        (["run", "--speed-forgetting", "1.5"], "--speed-forgetting"),
        (["run", "--target-metric", "accuracy>0.9"], "--target-metric: 'accuracy>0.9' is not METRIC>=VALUE"),
        (["run", "--global-batch", "x"], "--global-batch"),
        (["run", "--max-batches", "64", "32"], "--max-batches: 2 given for 3 workers"),
        (["run", "--max-batches", "64", "-1", "0"], "--max-batches: [64, -1, 0] holds a negative"),
        (["run", "--micro-batch", "16", "--pipeline", "on"], "--micro-batch: the pipelined step"),
        (["worker", "--slowdown", "0.5"], "below 1"),
        (["worker", "--max-batch", "-1"], "--max-batch"),
        (["worker", "--loader-workers", "-2"], "--loader-workers"),
        (["ps", "--shard-index", "-7"], "--shard-index"),
        (["scheduler", "--lr", "-1"], "--lr"),
        (["export", "runs/some-run"], "--out: name the file to write"),
        (["check", "--batches", "16", "16"], "--batches 16 16: two or more different sizes"),
        (["nonsense"], "unknown command"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, needle):
    out = _run(*args)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr


def test_bad_environment_defaults_name_the_variable():
    out = _run("scheduler", env={"DYNABATCH_LR": "fast"})
    assert out.returncode == 2 and "DYNABATCH_LR" in out.stderr


def test_environment_supplies_defaults_and_flags_override_it():
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, JobConfig, env={"DYNABATCH_GLOBAL_BATCH": "512", "DYNABATCH_NESTEROV": "true"})
    job = from_args(JobConfig, parser.parse_args([]))
    assert job.global_batch == 512 and job.nesterov is True
    job = from_args(JobConfig, parser.parse_args(["--global-batch", "64", "--no-nesterov"]))
    assert job.global_batch == 64 and job.nesterov is False


def test_missing_data_says_how_to_get_it(tmp_path):
    env = {"HOME": str(tmp_path), "DYNABATCH_DATA_DIR": str(tmp_path)}
    out = _run("run", "--dataset", "cifar10", "--model", "resnet", "--out", str(tmp_path / "runs"), env=env)
    assert out.returncode == 2
    assert "cifar-10-python.tar.gz" in out.stderr and "--data-dir" in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing may be started or written for a run that cannot work"


def test_a_run_folder_that_holds_a_run_is_never_reused(tmp_path):
    """Its shards would silently resume from the old checkpoints."""
    old = tmp_path / "runs" / "exp1"
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "shard-0.pt").write_bytes(b"an earlier run's model")
    out = _run("run", "--dataset", "synthetic", "--model", "mlp", "--out", str(tmp_path / "runs"), "--name", "exp1")
    assert out.returncode == 2
    assert str(old) in out.stderr and "--name" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in old.rglob("*")) == ["checkpoints", "shard-0.pt"], "nothing was written into it"


COMMANDS = ("run", "scheduler", "ps", "worker", "export", "check", "keys")


def test_help_lists_every_command_on_a_line_of_its_own():
    """Each command is a row of the command table, matched as a whole word at the row's start ("run" alone, not
    the "run" inside "dry-run")."""
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("commands:", 1)[1]
    listed = [m.group(1) for m in re.finditer(r"^  (\S+) +\S", table, re.MULTILINE)]
    assert listed == list(COMMANDS), out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_is_its_own(command):
    out = _run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: dynabatch {command} "), out.stdout[:200]
    assert "--help" in out.stdout and "Traceback" not in out.stderr


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_process_goes_on(tmp_path):
    """How a process that stopped answering is read without stopping it."""
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp"])
    try:
        scheduler = c.scheduler()
        c.wait_status("the scheduler to answer", lambda s: True)
        os.kill(scheduler.proc.pid, signal.SIGUSR1)
        # The dump is written thread by thread: wait for the main thread's frame in the scheduler's loop.
        log = wait_for("the main thread's stack in the scheduler's log",
                       lambda: "scheduler/server.py" in scheduler.log_text() and scheduler.log_text())
        assert "Current thread" in log and "most recent call first" in log, log
        assert scheduler.alive() and c.status().job == "dynabatch"
    finally:
        c.stop()
