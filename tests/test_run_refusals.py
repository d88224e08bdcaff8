"""Bad input to `dynabatch run`: exit 2, one line saying what is wrong, nothing started, no run folder made.

Each case runs the real command line; the checks are the same for every case: the
exit code, the error line (argparse's one-line usage may come before it), no file
under --out and no process whose command line names the test's folder.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import child_env, command_line
from processes import mentioning

BUILTIN = ["--dataset", "synthetic", "--model", "mlp"]
USAGE = "usage: dynabatch run [flags]   (--help lists them)"


def refuse(tmp_path: Path, flags: list[str], timeout_s: float = 120) -> str:
    """Run `dynabatch run --out TMP/out --name r FLAGS`; its error line, once every check has passed."""
    out = tmp_path / "out"
    done = subprocess.run(command_line("run", ["--out", str(out), "--name", "r", *flags]), capture_output=True,
                          text=True, timeout=timeout_s, env=child_env())
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 or lines[:-1] == [USAGE], done.stderr
    assert not out.exists() or not any(out.iterdir()), "a refused run makes no run folder"
    assert not mentioning(str(tmp_path)), "a refused run starts no process"
    assert done.stdout == ""
    return lines[-1]


@pytest.mark.parametrize("flag, value", [
    ("--epochs", "nan"), ("--epochs", "inf"), ("--lr", "nan"), ("--lr", "-inf"), ("--timeout-s", "inf"),
    ("--eval-interval-s", "nan"), ("--momentum", "nan"), ("--time-budget-s", "inf"), ("--warmup-fraction", "nan"),
])
def test_a_number_that_is_not_finite_is_refused(tmp_path, flag, value):
    assert refuse(tmp_path, [*BUILTIN, f"{flag}={value}"]) == (
        f"dynabatch run: error: {flag}: {float(value)} is not a finite number")


@pytest.mark.parametrize("flag", ["--epochs", "--lr", "--outer-lr"])
def test_a_zero_that_means_nothing_is_refused(tmp_path, flag):
    assert refuse(tmp_path, [*BUILTIN, flag, "0"]) == f"dynabatch run: error: {flag}: 0.0 must be above 0"


def test_a_number_from_the_environment_is_checked_as_a_flag_is(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNABATCH_EPOCHS", "nan")
    assert refuse(tmp_path, BUILTIN) == "dynabatch run: error: --epochs: nan is not a finite number"


def test_a_bad_flag_gets_one_line_of_usage_before_its_reason(tmp_path):
    assert refuse(tmp_path, ["--workers", "many"]) == "dynabatch run: error: argument --workers: invalid int value: 'many'"
    assert refuse(tmp_path, ["--no-such-flag"]) == "dynabatch run: error: unrecognized arguments: --no-such-flag"


def test_a_task_spec_without_a_colon_is_refused_before_torch_is_imported(tmp_path):
    assert refuse(tmp_path, ["--task", "mytask.py"]) == (
        "dynabatch run: error: --task 'mytask.py': expected FILE.py:ATTR or package.module:ATTR")
    probe = ("import sys\nfrom dynabatch.cluster.main import main\ntry:\n    main(['--task', 'mytask.py'])\n"
             "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=child_env())
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr


@pytest.mark.parametrize("command", ["run", "check", "export", "scheduler", "ps"])
def test_help_gives_each_flag_its_default_once(command):
    done = subprocess.run(command_line(command, ["--help"]), capture_output=True, text=True, timeout=60,
                          env=child_env())
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    flags = set(re.findall(r"^  (--[a-z-]+)", done.stdout, re.M)) - {"--help"}
    assert flags and text.count("[env DYNABATCH_") == len(flags - {"--log-level"}), text
    assert "] (default: " not in text, "argparse's own default repeats the one in the help text"
