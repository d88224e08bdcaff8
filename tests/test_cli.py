"""The command line refuses bad flags and missing data with a clear message, before starting anything."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from dynabatch.cluster.export_command import main as export_main
from dynabatch.cluster.main import parse as parse_run
from dynabatch.cluster.options import RunOptions
from dynabatch.common.config import JobConfig, MetricsOptions
from dynabatch.common.flags import TOPICS, FlagParser, add_flags, from_args, given
from dynabatch.common.net.curve import CurveOptions
from dynabatch.ps.options import PsOptions
from dynabatch.scheduler.options import SchedulerOptions
from dynabatch.worker.options import WorkerOptions
from hang_guard import hang_guard_s
from harness import Cluster, wait_for


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(timeout),
        env={**os.environ, **(env or {})},
    )


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
        (["scheduler", "--protocol", "asgd", "--sync-m", "2"], "--sync-m 2: only --protocol msync reads it"),
        (
            ["run", "--protocol", "auto", "--aggregation", "median", "--prefetch-pull"],
            "--protocol auto: no protocol it chooses among takes this job",
        ),
        (["scheduler", "--protocol", "auto", "--cluster-profile", "no-such.json"], "--cluster-profile: no-such.json"),
        (["export", "runs/some-run"], "--out: name the file to write"),
        (["check", "--batches", "16", "16"], "--batches 16 16: two or more different sizes"),
        (["check", "--link-mbit", "100"], "--link-mbit: only --save-profile FILE.json records it"),
        (["check", "--device-max-batch", "64"], "--device-max-batch: only --save-profile FILE.json records it"),
        (["nonsense"], "unknown command"),
        (["run", "--epoch", "1"], "unrecognized arguments: --epoch 1"),
        (["worker", "--evaluat"], "unrecognized arguments: --evaluat"),
        (["scheduler", "--epoch", "1"], "unrecognized arguments: --epoch 1"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], needle: str) -> None:
    out = _run(*args)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr


def test_bad_environment_defaults_name_the_variable() -> None:
    out = _run("scheduler", env={"DYNABATCH_LR": "fast"})
    assert out.returncode == 2 and "DYNABATCH_LR" in out.stderr


def test_environment_supplies_defaults_and_flags_override_it() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, JobConfig, env={"DYNABATCH_GLOBAL_BATCH": "512", "DYNABATCH_NESTEROV": "true"})
    job = from_args(JobConfig, parser.parse_args([]))
    assert job.global_batch == 512 and job.nesterov is True
    job = from_args(JobConfig, parser.parse_args(["--global-batch", "64", "--no-nesterov"]))
    assert job.global_batch == 64 and job.nesterov is False


def test_a_flag_counts_as_given_on_the_command_line_or_in_the_environment_even_at_its_default_value() -> None:
    """Where a setting in a file gives way to a flag (plan's cluster file and --global-batch), a flag typed at its
    default value must still win: only `given` can tell it from one left alone."""
    parser = FlagParser("dynabatch t")
    add_flags(parser, JobConfig, env={"DYNABATCH_NESTEROV": "false"})
    parser.add_argument("--name", action="append", default=[])  # not a field's flag: never marked, still parsed
    default_batch = JobConfig.global_batch
    args = parser.parse_args(["--global-batch", str(default_batch), "--name", "a", "--name", "b"])
    assert given(args, "global_batch") and args.global_batch == default_batch
    assert given(args, "nesterov"), "set by the environment, to its default value"
    assert not given(args, "epochs") and args.epochs == JobConfig.epochs
    assert args.name == ["a", "b"]
    assert not given(parser.parse_args([]), "global_batch")


def test_a_command_that_reads_some_of_a_schemas_settings_takes_those_flags_alone() -> None:
    """`only`: the rest keep their defaults and are refused as flags, whatever the environment holds."""
    parser = FlagParser("dynabatch t")
    only = ("global_batch", "model")
    add_flags(parser, JobConfig, env={"DYNABATCH_EPOCHS": "3", "DYNABATCH_MODEL": "mlp"}, only=only)
    job = from_args(JobConfig, parser.parse_args(["--global-batch", "64"]), only=only)
    assert (job.global_batch, job.model, job.epochs) == (64, "mlp", JobConfig.epochs)
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--epochs", "3"])
    assert refused.value.code == 2


def test_export_does_not_take_runs_out_folder_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DYNABATCH_OUT is `dynabatch run --out`, the folder run folders go in; export's --out is the file it writes, so
    a container set up for runs made export refuse an --out the user never gave (`... is a folder`)."""
    monkeypatch.setenv("DYNABATCH_OUT", str(tmp_path))
    with pytest.raises(SystemExit) as refused:
        export_main([str(tmp_path)])
    assert refused.value.code == 2 and "--out: name the file to write" in capsys.readouterr().err
    monkeypatch.setenv("DYNABATCH_EXPORT_OUT", str(tmp_path / "model.pt"))
    assert export_main([str(tmp_path)]) == 2 and "holds no run" in capsys.readouterr().err, "its own variable"


def test_missing_data_says_how_to_get_it(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "DYNABATCH_DATA_DIR": str(tmp_path)}
    out = _run("run", "--dataset", "cifar10", "--model", "resnet", "--out", str(tmp_path / "runs"), env=env)
    assert out.returncode == 2
    assert "cifar-10-python.tar.gz" in out.stderr and "--data-dir" in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing may be started or written for a run that cannot work"


def test_a_run_folder_that_holds_a_run_is_never_reused(tmp_path: Path) -> None:
    """Its shards would silently resume from the old checkpoints."""
    old = tmp_path / "runs" / "exp1"
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "shard-0.pt").write_bytes(b"an earlier run's model")
    out = _run("run", "--dataset", "synthetic", "--model", "mlp", "--out", str(tmp_path / "runs"), "--name", "exp1")
    assert out.returncode == 2
    assert str(old) in out.stderr and "--name" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in old.rglob("*")) == ["checkpoints", "shard-0.pt"], "nothing was written into it"


COMMANDS = ("run", "scheduler", "ps", "worker", "export", "check", "plan", "preload", "keys")


def test_a_global_batch_below_the_workers_least_batches_is_noted(capsys: pytest.CaptureFixture[str]) -> None:
    """The split then holds more than B; it was said only in summary.json's decisions."""
    parse_run(["--global-batch", "2"])
    assert capsys.readouterr().err == (
        "dynabatch run: note: --global-batch 2 is below 3 workers x --min-batch 8: a step of every worker takes at "
        "least 24 samples\n"
    )
    parse_run([])
    assert capsys.readouterr().err == ""


def test_no_command_is_a_usage_error_on_stderr() -> None:
    out = _run()
    assert out.returncode == 2 and out.stdout == "" and out.stderr.startswith("usage: dynabatch COMMAND")


def test_help_lists_every_command_on_a_line_of_its_own() -> None:
    """Each command is a row of the command table, matched as a whole word at the row's start ("run" alone, not
    the "run" inside "dry-run")."""
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("commands:", 1)[1]
    listed = [m.group(1) for m in re.finditer(r"^  (\S+) +\S", table, re.MULTILINE)]
    assert listed == list(COMMANDS), out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_is_its_own(command: str) -> None:
    out = _run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: dynabatch {command} "), out.stdout[:200]
    assert "--help" in out.stdout and "Traceback" not in out.stderr


def test_no_commands_help_imports_torch() -> None:
    """Help is instant: torch's import costs seconds of CPU, and each command imports it only once it needs it
    (export and plan did at their start, for a --help or a flag's error)."""
    probe = (
        "import contextlib, io, sys\nfrom dynabatch.cli.main import COMMANDS, main\n"
        "for command in COMMANDS:\n    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n            main([command, '--help'])\n        except SystemExit:\n            pass\n"
        "    print(command, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=hang_guard_s(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [word for command in COMMANDS for word in (command, "False")], done.stdout


# The config classes each command's flags come from, as its main parses them.
FLAG_CLASSES = {
    "run": (RunOptions, JobConfig, CurveOptions),
    "scheduler": (SchedulerOptions, JobConfig, CurveOptions, MetricsOptions),
    "ps": (PsOptions, CurveOptions, MetricsOptions),
    "worker": (WorkerOptions, CurveOptions, MetricsOptions),  # `worker --evaluator` is the same command
}


def help_topics(text: str) -> list[tuple[str, str]]:
    """(heading's first word, flag) for each flag line of a `--help`, in order."""
    rows, heading = [], ""
    for line in text.splitlines():
        if (title := re.match(r"^(\w[\w ]*?)(?: \(.*\))?:$", line)) is not None:
            heading = title.group(1)
        elif (flag := re.match(r"^  (--[a-z-]+)", line)) is not None:
            rows.append((heading, flag.group(1)))
    return rows


@pytest.mark.parametrize("command", FLAG_CLASSES)
def test_help_lists_each_flag_once_under_the_topic_its_field_names(command: str) -> None:
    """The topic comes from the flag's own definition (its opt() metadata); the headings follow TOPICS' order."""
    out = _run(command, "--help")
    assert out.returncode == 0, out.stderr
    rows = [(heading, flag) for heading, flag in help_topics(out.stdout) if flag != "--help"]
    flags = [flag for _, flag in rows]
    assert len(flags) == len(set(flags)), f"a flag listed twice: {sorted(f for f in flags if flags.count(f) > 1)}"
    expected = {
        "--" + f.name.replace("_", "-"): f.metadata["topic"]
        for cls in FLAG_CLASSES[command]
        for f in dataclasses.fields(cls)
    }
    if command != "run":
        expected["--log-level"] = "observability"
    assert dict((flag, heading) for heading, flag in rows) == expected
    headings = list(dict.fromkeys(heading for heading, _ in rows))
    assert headings == [topic for topic in TOPICS if topic in headings], headings
    if command in ("run", "scheduler"):
        assert headings == list(TOPICS), headings


OPTION_MODULES = (
    "dynabatch.common.config",
    "dynabatch.common.shared_options",
    "dynabatch.common.net.curve",
    "dynabatch.cluster.options",
    "dynabatch.ps.options",
    "dynabatch.scheduler.options",
    "dynabatch.worker.options",
)
# Flags two option modules define with different meanings (each command has only one of them).
HOMONYMS = {
    "bind": "the scheduler's control endpoint; a shard's data endpoint",
    "threads": "a worker's torch threads for compute; a shard's for applying updates",
    "name": "dynabatch run's run folder; a shard's or a worker's name in logs",
    "evaluator": "dynabatch run starts one; dynabatch worker --evaluator is one",
    "task": "what a job trains; the task dynabatch export loads a run's weights into (default: the run's own)",
    "max_batch": "the job's largest batch of any worker; one machine's largest batch (its memory)",
}


def test_no_flag_is_defined_in_two_option_modules() -> None:
    """A flag that one command forwards to another (run to its workers and shards), or that two roles take
    alike (ps and worker join a job the same way), has one definition that both inherit."""
    owners: dict[str, set[str]] = defaultdict(set)
    for module_name in OPTION_MODULES:
        for cls in vars(importlib.import_module(module_name)).values():
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module_name:
                for name in cls.__dict__.get("__annotations__", {}):  # its own fields, not inherited ones
                    if "topic" in cls.__dataclass_fields__[name].metadata:
                        owners[name].add(module_name)
    twice = {name: sorted(modules) for name, modules in owners.items() if len(modules) > 1}
    assert set(twice) == set(HOMONYMS), {name: twice[name] for name in set(twice) - set(HOMONYMS)}
    run, worker, ps = (cls.__dataclass_fields__ for cls in (RunOptions, WorkerOptions, PsOptions))
    forwarded = {"task", "data_dir", "init", "threads", "micro_batch", "loader_workers"}
    assert all(run[name] is worker[name] for name in forwarded), "run's worker flags are the worker's own"
    assert run["checkpoint_interval_s"] is ps["checkpoint_interval_s"]
    assert all(ps[name] is worker[name] for name in ("job", "scheduler", "on_finish"))


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_process_goes_on(tmp_path: Path) -> None:
    """How a process that stopped answering is read without stopping it, as often as it is asked."""
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp"])
    try:
        scheduler = c.scheduler()
        c.wait_status("the scheduler to answer", lambda s: True)

        def dumped(dumps: int) -> str | None:
            """The log once it holds `dumps` dumps; a scheduler that died of one fails at once, with its log."""
            text = scheduler.log_text()
            assert scheduler.alive(), f"the scheduler died after {dumps - 1} dumps; its log:\n{text[-4000:]}"
            return text if text.count("Current thread") >= dumps else None

        for dumps in range(1, 4):
            os.kill(scheduler.proc.pid, signal.SIGUSR1)
            # One dump per signal, written from the main thread: its frame in the scheduler's loop is in it.
            log = wait_for(f"dump {dumps} in the scheduler's log", functools.partial(dumped, dumps))
            assert log.count("Current thread") == dumps, log[-4000:]
        assert "scheduler/server.py" in log and "most recent call first" in log, log
        status = c.status()
        assert status is not None
        assert scheduler.alive() and status.job == "dynabatch"
    finally:
        c.stop()
