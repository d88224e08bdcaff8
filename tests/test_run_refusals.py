"""Bad input to `dynabatch run`: exit 2, one line saying what is wrong, nothing started, no run folder made.

Each case runs the real command line; the checks are the same for every case: the
exit code, the error line (argparse's one-line usage may come before it), no file
under --out and no process whose command line names the test's folder.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness import child_env, command_line
from processes import mentioning

BUILTIN = ["--dataset", "synthetic", "--model", "mlp"]


def refuse(tmp_path: Path, flags: list[str], timeout_s: float = 120) -> str:
    """Run `dynabatch run --out TMP/out --name r FLAGS`; its error line, once every check has passed."""
    out = tmp_path / "out"
    done = subprocess.run(command_line("run", ["--out", str(out), "--name", "r", *flags]), capture_output=True,
                          text=True, timeout=timeout_s, env=child_env())
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert lines, done.stderr
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
