"""However `dynabatch run` ends, its children end with it, and an interrupted run still reports.

Each test starts a real run (scheduler, shard, worker, evaluator), waits until the
evaluator has evaluated a trained model, ends the run one way, and checks the exit code,
the console, the summary, that no process of the run is left and no temporary file.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import wait_for
from run_process import FOREVER, RunProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def run(tmp_path: Path) -> Iterator[RunProcess]:
    r = RunProcess(tmp_path, tmp_path / "run.err", FOREVER)
    yield r
    r.close()


def _interrupted_summary(run: RunProcess, out: str, evaluated: int) -> None:
    """summary.json says interrupted, with the last evaluated model's figures and version (at least `evaluated`,
    which the test saw before it signalled), and so does stdout."""
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["interrupted"] and not summary["finished"]
    assert summary["final_eval_version"] >= evaluated and summary["model_version"] >= summary["final_eval_version"]
    assert summary["final_test_acc"] is not None
    line = re.search(
        r"^interrupted at model v(\d+) \(epoch [\d.]+\); last evaluation, of model v(\d+) at [\d.]+ s: "
        r"test accuracy ([\d.]+)%",
        out,
        re.M,
    )
    assert line, out
    assert int(line.group(2)) == summary["final_eval_version"]
    assert float(line.group(3)) == pytest.approx(100 * summary["final_test_acc"], abs=0.006)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_stops_the_run_in_order_and_reports_the_last_evaluated_model(
    run: RunProcess, sig: signal.Signals
) -> None:
    evaluated = run.trained_and_evaluated()
    run.proc.send_signal(sig)
    rc, out, err = run.end()
    assert rc == 128 + sig, err
    assert "Traceback" not in err, err
    assert "stopping (Ctrl-C again to force)..." in err
    assert not run.leftovers(0), "every child was stopped before the run exited"
    _interrupted_summary(run, out, evaluated)
    assert not run.temporary_files()


def test_a_second_ctrl_c_kills_every_child_and_still_reports(run: RunProcess) -> None:
    run.trained_and_evaluated()
    # Forced, the run reports what it had seen: under load its last STATUS can predate the evaluation the test saw.
    wait_for("the run to show an evaluation", lambda: re.search(r"test \d+\.\d+%", run.printed()), 60)
    run.proc.send_signal(signal.SIGINT)
    wait_for("the run to begin stopping", lambda: "stopping" in run.err_path.read_text(), 30)
    run.proc.send_signal(signal.SIGINT)
    rc, out, err = run.end()
    assert rc == 130, err
    assert "Traceback" not in err, err
    assert "forced: killing every process of the run" in err
    assert not run.leftovers(0), "every child was killed before the run exited"
    # Forced, the run may not have taken its last STATUS (the scheduler is killed too): it reports the last
    # evaluation it had seen, which may be older than the one the test saw.
    _interrupted_summary(run, out, 0)


def test_children_of_a_run_killed_outright_end_with_it(run: RunProcess) -> None:
    run.trained_and_evaluated()
    run.proc.kill()
    rc, _, _ = run.end()
    assert rc == -signal.SIGKILL
    # They get SIGTERM from the kernel and stop as on Ctrl-C: within the launcher's own stop bound.
    assert not run.leftovers(30), "the parent-death signal ends every child"
    assert not run.temporary_files()
