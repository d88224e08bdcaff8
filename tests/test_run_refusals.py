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

from dynabatch.cluster.main import parse as parse_run
from hang_guard import hang_guard_s
from harness import child_env, command_line
from processes import mentioning

BUILTIN = ["--dataset", "synthetic", "--model", "mlp"]
USAGE = "usage: dynabatch run [flags]   (--help lists them)"


def refuse(tmp_path: Path, flags: list[str], timeout_s: float = 120) -> str:
    """Run `dynabatch run --out TMP/out --name r FLAGS`; its error line, once every check has passed."""
    out = tmp_path / "out"
    done = subprocess.run(
        command_line("run", ["--out", str(out), "--name", "r", *flags]),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(),
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 or lines[:-1] == [USAGE], done.stderr
    assert not out.exists() or not any(out.iterdir()), "a refused run makes no run folder"
    assert not mentioning(str(tmp_path)), "a refused run starts no process"
    assert done.stdout == ""
    return lines[-1]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--epochs", "nan"),
        ("--epochs", "inf"),
        ("--lr", "nan"),
        ("--lr", "-inf"),
        ("--timeout-s", "inf"),
        ("--eval-interval-s", "nan"),
        ("--momentum", "nan"),
        ("--time-budget-s", "inf"),
        ("--warmup-fraction", "nan"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(tmp_path: Path, flag: str, value: str) -> None:
    assert refuse(tmp_path, [*BUILTIN, f"{flag}={value}"]) == (
        f"dynabatch run: error: {flag}: {float(value)} is not a finite number"
    )


@pytest.mark.parametrize("flag", ["--epochs", "--outer-lr"])  # --lr 0 is the default: the tuned step (test_base_lr)
def test_a_zero_that_means_nothing_is_refused(tmp_path: Path, flag: str) -> None:
    assert refuse(tmp_path, [*BUILTIN, flag, "0"]) == f"dynabatch run: error: {flag}: 0.0 must be above 0"


def test_an_m_above_the_workers_is_refused(tmp_path: Path) -> None:
    flags = [*BUILTIN, "--protocol", "msync", "--workers", "2", "--slowdowns", "1", "1"]
    assert refuse(tmp_path, [*flags, "--sync-m", "3"]) == (
        "dynabatch run: error: --sync-m 3: a round takes the first m gradients of m different workers, and the job "
        "starts with 2 worker(s) (--min-workers; dynabatch run: --workers): choose m between 1 and 2, or 0 for every "
        "live worker"
    )
    assert refuse(tmp_path, [*BUILTIN, "--protocol", "msync", "--sync-m", "-1"]) == (
        "dynabatch run: error: --sync-m: -1 is below the minimum 0"
    )


def parsed_refusal(capsys: pytest.CaptureFixture[str], flags: list[str]) -> str:
    """`dynabatch run FLAGS` parsed in this process as the command parses it (nothing is started before its flags
    are settled): its error line. `refuse` runs the whole command for a case of each kind below."""
    with pytest.raises(SystemExit) as exited:
        parse_run([*BUILTIN, *flags])
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("flag", ["--momentum", "--outer-momentum"])
def test_a_momentum_of_one_or_more_is_refused(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """A momentum of 1 never forgets a step, and one above it grows every step without bound: the loss ran to 6e26
    and the job to 13.7% accuracy before this was refused."""
    for value in ("1", "1.5"):
        assert parsed_refusal(capsys, [flag, value]) == f"dynabatch run: error: {flag}: {float(value)} must be below 1"


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--protocol", "ssgd", "--outer-lr", "0.5"],
            "--outer-lr 0.5: only --protocol local or msd reads it, not ssgd",
        ),
        (["--protocol", "ssgd", "--staleness-step", "delay"], "--staleness-step delay: only --protocol asgd or ssp or"),
        (["--protocol", "asgd", "--cluster-profile", "c.json"], "--cluster-profile c.json: only --protocol auto reads"),
    ],
)
def test_a_setting_only_another_protocol_reads_is_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], line: str
) -> None:
    """It would be ignored without a word; under --protocol auto, which may run any of them, each is taken."""
    assert parsed_refusal(capsys, flags).startswith(f"dynabatch run: error: {line}")


def test_a_setting_only_another_protocol_reads_stops_the_whole_command(tmp_path: Path) -> None:
    line = refuse(tmp_path, [*BUILTIN, "--protocol", "asgd", "--sync-m", "2"])
    assert line == "dynabatch run: error: --sync-m 2: only --protocol msync reads it, not asgd; drop it"


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--no-evaluator", "--await-final-eval"], "--await-final-eval: this run starts no evaluator"),
        (["--workers", "2", "--slowdowns", "1", "--min-workers", "3"], "--min-workers 3: this run starts 2 worker(s)"),
        (["--max-workers", "3"], "--max-workers 3: this run starts 3 worker(s) and an evaluator, 4 members"),
    ],
)
def test_flags_that_would_leave_the_run_waiting_or_its_members_refused_are_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], line: str
) -> None:
    """Each ran: the first waited --join-timeout-s after training for an evaluator it never started, the second
    handed out no batch until --timeout-s (an hour), the third crashed the members past the limit through their
    restarts."""
    assert parsed_refusal(capsys, flags).startswith(f"dynabatch run: error: {line}")


def test_a_number_from_the_environment_is_checked_as_a_flag_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNABATCH_EPOCHS", "nan")
    assert refuse(tmp_path, BUILTIN) == "dynabatch run: error: --epochs: nan is not a finite number"


def test_a_bad_flag_gets_one_line_of_usage_before_its_reason(tmp_path: Path) -> None:
    assert refuse(tmp_path, ["--workers", "many"]) == (
        "dynabatch run: error: argument --workers: invalid int value: 'many'"
    )
    assert refuse(tmp_path, ["--no-such-flag"]) == "dynabatch run: error: unrecognized arguments: --no-such-flag"


def test_a_task_spec_without_a_colon_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    assert refuse(tmp_path, ["--task", "mytask.py"]) == (
        "dynabatch run: error: --task 'mytask.py': expected FILE.py:ATTR or package.module:ATTR"
    )
    probe = (
        "import sys\nfrom dynabatch.cluster.main import main\ntry:\n    main(['--task', 'mytask.py'])\n"
        "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=hang_guard_s(60), env=child_env()
    )
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr


@pytest.mark.parametrize("command", ["run", "check", "export", "scheduler", "ps", "worker"])
def test_help_gives_each_flag_its_default_once(command: str) -> None:
    done = subprocess.run(
        command_line(command, ["--help"]), capture_output=True, text=True, timeout=hang_guard_s(60), env=child_env()
    )
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    flags = set(re.findall(r"^  (--[a-z-]+)", done.stdout, re.M)) - {"--help"}
    assert flags and text.count("[env DYNABATCH_") == len(flags - {"--log-level"}), text
    assert "] (default: " not in text, "argparse's own default repeats the one in the help text"


TASKS = Path(__file__).resolve().parent / "tasks"
BAD = TASKS / "bad.py"


@pytest.mark.slow  # each case imports torch twice (run, then check)
@pytest.mark.parametrize(
    "attr, line",
    [
        ("empty_eval", "eval_data() gave an empty dataset"),
        (
            "float_metric",
            "metric <lambda> returned a float; a metric returns {name: (sum, count)}, "
            "e.g. {'accuracy': (correct, samples)}",
        ),
        (
            "no_grad_loss",
            "the loss has no gradient (no grad_fn): compute it from the model's output with torch "
            "operations, not through .item(), .detach(), numpy or torch.no_grad()",
        ),
        ("no_eval", "the task has no eval_data for the evaluator: give it one, or pass --no-evaluator"),
    ],
)
def test_a_task_that_would_fail_in_a_worker_is_refused_before_start(tmp_path: Path, attr: str, line: str) -> None:
    assert refuse(tmp_path, ["--task", f"{BAD}:{attr}"]) == f"dynabatch run: {line}"
    if attr != "no_eval":  # check has no evaluator to start
        done = subprocess.run(
            command_line("check", ["--task", f"{BAD}:{attr}"]),
            capture_output=True,
            text=True,
            timeout=hang_guard_s(120),
            env=child_env(),
        )
        assert (done.returncode, done.stderr) == (2, f"dynabatch check: {line}\n")


@pytest.mark.slow  # a task's check imports torch
def test_a_target_metric_the_evaluations_do_not_report_is_refused(tmp_path: Path) -> None:
    assert refuse(tmp_path, [*BUILTIN, "--target-metric", "bleu>=0.9"]) == (
        "dynabatch run: --target-metric bleu>=0.9: the evaluations report accuracy, loss, not bleu"
    )
    assert refuse(tmp_path, ["--task", f"{TASKS / 'blobs.py'}:task", "--target-metric", "bleu>=0.9"]).startswith(
        "dynabatch run: --target-metric bleu>=0.9: the evaluations report "
    )


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", "/abs"])
def test_a_run_name_that_leaves_out_is_refused(tmp_path: Path, name: str) -> None:
    assert refuse(tmp_path, [*BUILTIN, "--name", name]) == (
        f"dynabatch run: error: --name {name}: the run folder's name inside --out, without / or .."
    )
    assert not (tmp_path.parent / "escape").exists()


def test_an_out_that_cannot_hold_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file")
    done = subprocess.run(
        command_line("run", ["--out", str(tmp_path / "out"), "--name", "r", *BUILTIN]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        env=child_env(),
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"dynabatch run: --out {tmp_path / 'out'}: cannot write the run "
        f"folder {tmp_path / 'out' / 'r'}: Not a directory\n",
    )
    assert (tmp_path / "out").read_text() == "a file" and not mentioning(str(tmp_path))


def test_a_data_dir_that_is_not_there_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    assert refuse(tmp_path, ["--dataset", "fashion-mnist", "--data-dir", str(missing)]) == (
        f"dynabatch run: --data-dir {missing}: no such folder"
    )


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_idx_files_in_the_data_dir_are_refused_before_start(tmp_path: Path, damage: str) -> None:
    from test_data import write_fake_mnist

    folder = tmp_path / "data"
    write_fake_mnist(folder, gz=False)
    images = folder / "train-images-idx3-ubyte"
    raw = images.read_bytes()
    images.write_bytes(raw[:-100] if damage == "truncated" else b"\x01\x02" + raw[2:])
    expected = (
        "header declares [50, 28, 28] = 39200 bytes of data, file holds 39100; truncated or corrupt"
        if damage == "truncated"
        else "not a uint8 idx file (bad magic number 01020803)"
    )
    assert refuse(tmp_path, ["--dataset", "fashion-mnist", "--data-dir", str(folder)]) == (
        f"dynabatch run: {images}: {expected}"
    )
