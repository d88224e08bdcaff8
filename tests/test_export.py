"""Results out, weights in: `dynabatch export`, `--init`, and `db.run` with its trained model.

One trained run, made by `db.run` with two shards and small chunks (so the model is
cut across both shards), serves every test that needs one. The assembling is also
tested directly, with checkpoints that carry buffers of their own.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dynabatch as db
from dynabatch.cluster import export_command
from dynabatch.cluster.export import TrainedState, assemble, load_trained, read_run
from dynabatch.cluster.export_command import main as export_main
from dynabatch.cluster.python_run import ACTIVE_ENV, task_spec
from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError
from dynabatch.common.tasks.task_check import check_task, load_task
from dynabatch.common.tasks.weights import load_weights, read_state_dict
from dynabatch.common.wire.model_signature import signature_fields
from dynabatch.task import Task
from dynabatch.task_error import TaskError
from hang_guard import hang_guard_s
from harness import Cluster, child_env, command_line, run_job, wait_for
from run_process import RunProcess

TASKS = Path(__file__).resolve().parent / "tasks"
BLOBS = f"{TASKS / 'blobs.py'}:task"
POINT = 0.005  # half a percentage point


def plain_torch_metrics(model: nn.Module, task: Task) -> dict[str, float]:
    """The blobs task's loss and accuracy over its whole evaluation set, in plain PyTorch."""
    assert task.eval_data is not None
    test = task.eval_data()
    whole = task.collate_fn()([test[i] for i in range(len(test))])
    model.eval()
    with torch.no_grad():
        correct, count = task.metric_fns()[0](model, whole)["accuracy"]
        return {"loss": float(task.loss_fn()(model, whole)), "accuracy": correct / count}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> db.Run:
    """blobs trained by `db.run` from a Task object imported as a user's script imports it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(TASKS))
        import blobs

        return db.run(
            blobs.task,
            workers=2,
            slowdowns=[1, 2],
            epochs=10,
            global_batch=64,
            eval_interval_s=2,
            shards=2,
            chunk_bytes=1024,
            out=str(tmp_path_factory.mktemp("runs")),
            name="trained",
            timeout_s=240,
        )


def export(run_dir: Path, out: Path, *extra: str) -> int:
    return export_command.main([str(run_dir), "--out", str(out), *extra])


@pytest.mark.slow
def test_db_run_returns_the_run_folder_its_summary_and_the_trained_model(trained: db.Run) -> None:
    task = load_task(BLOBS)
    assert trained.summary["finished"] and trained.summary["final_eval"], trained.summary
    assert trained.dir.name == "trained" and sorted(p.name for p in (trained.dir / "checkpoints").glob("*.pt")) == [
        "shard-0.pt",
        "shard-1.pt",
    ]
    ours, reported = plain_torch_metrics(trained.model, task), trained.summary["final_metrics"]
    assert abs(ours["accuracy"] - reported["accuracy"]) <= POINT, (ours, reported)
    untrained = plain_torch_metrics(task.build_model(0), task)["accuracy"]
    assert ours["accuracy"] > 0.9 > 0.5 > untrained, "the model returned must be the trained one, not the initial"


@pytest.mark.slow
def test_export_writes_a_state_dict_that_plain_pytorch_evaluates_to_the_reported_metrics(
    trained: db.Run, tmp_path: Path
) -> None:
    out = tmp_path / "exported" / "model.pt"
    done = subprocess.run(
        command_line("export", [str(trained.dir), "--out", str(out)]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "did not finish" not in done.stderr
    task = load_task(BLOBS)
    model = task.model()  # a user's own model, built without dynabatch
    state = torch.load(out)
    assert list(state) == list(model.state_dict())
    model.load_state_dict(state)
    ours, reported = plain_torch_metrics(model, task), trained.summary["final_metrics"]
    assert abs(ours["accuracy"] - reported["accuracy"]) <= POINT, (ours, reported)
    assert ours["loss"] == pytest.approx(reported["loss"], rel=1e-4, abs=1e-7), (ours, reported)


def test_export_of_a_run_that_did_not_finish_says_so(
    trained: db.Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its summary says why (a run that failed or was stopped writes one): the model is as last checkpointed."""
    folder = tmp_path / "run"
    shutil.copytree(trained.dir, folder)
    summary = json.loads((folder / "summary.json").read_text())
    summary.update(finished=False, failed="worker1 exited with code 1 after 3 restart(s) (--restarts 3); the run fails")
    (folder / "summary.json").write_text(json.dumps(summary))
    assert export_main([str(folder), "--out", str(tmp_path / "model.pt")]) == 0
    assert (tmp_path / "model.pt").is_file()
    err = capsys.readouterr().err
    assert err.startswith("dynabatch export: note: the run did not finish (worker1 exited"), err
    assert f"after {summary['epochs_trained']:.3g} epochs" in err


@pytest.mark.slow
def test_db_export_gives_the_model_db_run_returned(trained: db.Run) -> None:
    model = db.export(str(trained.dir))  # a folder's name as a user types it; the task is the one the run recorded
    ours, theirs = model.state_dict(), trained.model.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_db_export_refuses_a_folder_that_holds_no_run(tmp_path: Path) -> None:
    with pytest.raises(db.ExportError, match="holds no run"):
        db.export(tmp_path)


def test_export_refuses_a_folder_that_holds_no_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert export(tmp_path, tmp_path / "model.pt") == 2
    assert "holds no run (no config.json" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
def test_export_names_a_missing_shard_checkpoint(
    trained: db.Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    partial = tmp_path / "partial"
    (partial / "checkpoints").mkdir(parents=True)
    shutil.copy(trained.dir / "config.json", partial / "config.json")
    shutil.copy(trained.dir / "checkpoints" / "shard-0.pt", partial / "checkpoints" / "shard-0.pt")
    assert export(partial, tmp_path / "model.pt") == 2
    assert "no checkpoint of shard-1.pt (the job ran 2 shard(s)" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
def test_export_refuses_a_task_whose_model_is_not_the_runs(
    trained: db.Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export(trained.dir, tmp_path / "model.pt", "--task", f"{TASKS / 'blobs_variants.py'}:wider") == 2
    assert "parameter 0 is 0.weight [48, 16] float32 here but 0.weight [32, 16]" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


def _batchnorm_task() -> Task:
    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        m[2].requires_grad_(False)  # frozen: never on the shards
        m.register_buffer("scale", torch.full((2,), 3.0))  # a buffer no forward changes
        return m

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return Task(model=model, train_data=lambda: data)


def test_assembling_takes_the_shards_parameters_the_checkpoints_buffers_and_the_factorys_frozen_state() -> None:
    task = _batchnorm_task()
    sig, _, _ = check_task(task, seed=5)
    flat = torch.arange(sig.total, dtype=torch.float32)
    states = [
        {
            "signature": signature_fields(sig),
            "params": {0: flat},
            "chunk_versions": {0: 7},
            "buffers": {"1.running_mean": torch.tensor([1.0, 2.0, 3.0])},
        }
    ]
    model = load_trained(task, 5, assemble(states, chunk_bytes=1 << 20))
    fresh = task.build_model(5)
    got, factory = model.state_dict(), fresh.state_dict()
    assert torch.equal(got["0.weight"].flatten(), flat[:12]) and torch.equal(got["1.bias"], flat[18:21])
    assert torch.equal(got["1.running_mean"], torch.tensor([1.0, 2.0, 3.0]))  # the checkpoint's buffer wins
    assert torch.equal(got["1.running_var"], factory["1.running_var"])  # the others are the factory's
    assert torch.equal(got["2.weight"], factory["2.weight"]) and torch.equal(got["scale"], factory["scale"])
    with pytest.raises(TaskError, match=r"buffer 1.running_avg \[3\], which the task's model does not have"):
        load_trained(task, 5, TrainedState(sig, assemble(states, 1 << 20).params, {"1.running_avg": torch.zeros(3)}))


def test_weights_that_do_not_fit_the_model_are_refused_naming_the_key(tmp_path: Path) -> None:
    model = _batchnorm_task().model()
    state = model.state_dict()
    for broken, message in (
        ({k: v for k, v in state.items() if k != "1.running_var"}, "has no 1.running_var"),
        ({**state, "3.weight": torch.zeros(1)}, "has 3.weight, which the task's model does not have"),
        ({**state, "0.weight": torch.zeros(3, 5)}, r"0.weight is \[3, 5\] there but \[3, 4\] in the task's model"),
    ):
        with pytest.raises(TaskError, match=message):
            load_weights(model, broken, "--init w.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(TaskError, match="holds a list, not a state_dict"):
        read_state_dict(tmp_path / "list.pt")
    with pytest.raises(TaskError, match="no file"):
        read_state_dict(tmp_path / "nowhere.pt")
    torch.save({"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}, tmp_path / "pickled.pt")
    with pytest.raises(TaskError) as refused:  # torch's refusal: a dozen lines with terminal colours
        read_state_dict(tmp_path / "pickled.pt")
    assert "\n" not in str(refused.value) and "objects other than tensors" in str(refused.value)
    loaded = _batchnorm_task().model()
    load_weights(loaded, {k: v + 1 for k, v in state.items()}, "--init w.pt")
    assert torch.equal(loaded.state_dict()["2.weight"], state["2.weight"] + 1), "frozen parameters load too"


def _first_evaluation(run_dir: Path) -> dict[str, Any]:
    timeline = json.loads((run_dir / "timeline.json").read_text())
    return next(s for s in timeline if s["metrics"])


@pytest.mark.slow
def test_init_starts_a_run_from_exported_weights(trained: db.Run, tmp_path: Path) -> None:
    assert export(trained.dir, tmp_path / "model.pt") == 0
    task = load_task(BLOBS)
    model = task.model()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    exported = plain_torch_metrics(model, task)["accuracy"]
    untrained = plain_torch_metrics(task.build_model(0), task)["accuracy"]
    assert exported - untrained > 0.5, "the test needs weights far from the initial model's"
    run, _ = run_job(
        tmp_path,
        "warm",
        "--task",
        BLOBS,
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--epochs",
        "0.05",
        "--global-batch",
        "64",
        "--init",
        str(tmp_path / "model.pt"),
    )
    first = _first_evaluation(run)
    assert abs(first["metrics"]["accuracy"] - exported) <= POINT, (first["eval_version"], first["metrics"], exported)


@pytest.mark.slow
def test_run_refuses_init_weights_of_another_model_before_starting_anything(tmp_path: Path) -> None:
    torch.save(load_task(f"{TASKS / 'blobs_variants.py'}:wider").model().state_dict(), tmp_path / "wider.pt")
    done = subprocess.run(
        command_line(
            "run", ["--out", str(tmp_path), "--name", "r", "--task", BLOBS, "--init", str(tmp_path / "wider.pt")]
        ),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env=child_env(),
    )
    assert done.returncode == 2, done.stderr
    assert "0.weight is [48, 16] there but [32, 16] in the task's model" in done.stderr
    assert not (tmp_path / "r").exists(), "nothing may be started or written"


@pytest.mark.slow
def test_a_worker_refuses_init_weights_of_another_model(tmp_path: Path) -> None:
    torch.save(load_task(f"{TASKS / 'blobs_variants.py'}:wider").model().state_dict(), tmp_path / "wider.pt")
    c = Cluster(tmp_path, ["--epochs", "1000"])
    try:
        c.scheduler()
        c.shard(0)
        bad = c.worker("bad", "--task", BLOBS, "--init", str(tmp_path / "wider.pt"))
        assert wait_for("the worker to exit", lambda: bad.proc.poll() is not None, 60) is not None
        assert bad.proc.returncode == 2 and "0.weight is [48, 16] there but [32, 16]" in bad.log_text(), bad.log_text()
    finally:
        c.stop()


def test_db_run_refuses_a_task_it_cannot_name() -> None:
    local = Task(model=lambda: nn.Linear(2, 2), train_data=lambda: [0])
    with pytest.raises(TaskError, match="define it at module level"):
        task_spec(local)
    assert task_spec("pkg.module:task") == "pkg.module:task"


def test_db_run_names_a_task_by_the_file_that_defines_it(tmp_path: Path) -> None:
    """A task of the script being run is named by the script's path; an imported one by its own module's file."""
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(TASKS)!r})\n"
        "import dynabatch as db\nfrom blobs import Blobs, make_model, task as imported\n"
        "from dynabatch.cluster.python_run import task_spec\n"
        "task = db.Task(model=make_model, train_data=lambda: Blobs(10, seed=1))\n"
        "print(task_spec(task))\nprint(task_spec(imported))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=hang_guard_s(120), env=child_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"{script.resolve()}:task", f"{(TASKS / 'blobs.py').resolve()}:task"]


def test_db_run_refuses_unknown_settings_and_a_nested_call(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="no setting epoch "):
        db.run(BLOBS, epoch=3)
    monkeypatch.setenv(ACTIVE_ENV, "1")
    with pytest.raises(TaskError, match='under `if __name__ == "__main__":`'):
        db.run(BLOBS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": "3"}, "db.run: workers='3' is not int"),
        ({"workers": 2.5}, "db.run: workers=2.5 is not int"),
        ({"workers": 2, "slowdowns": "12"}, "db.run: slowdowns='12' is not a list of factors"),  # ran 1 and 2
        ({"slowdowns": 2}, "db.run: slowdowns=2 is not a list of factors"),
        ({"out": 123}, "db.run: out=123 is not str"),
        ({"max_batches": [64, "x", 0]}, "db.run: max_batches=[64, 'x', 0] is not list[int]"),
        ({"global_batch": 64.5}, "job setting global_batch=64.5 is not int"),
    ],
)
def test_db_run_refuses_a_setting_of_the_wrong_type_by_name(kwargs: dict[str, Any], message: str) -> None:
    """Each was a raw TypeError from deep inside, a setting misnamed, or (a string of slowdowns) a job run."""
    with pytest.raises(db.ConfigError) as refused:
        db.run(BLOBS, **kwargs)
    assert str(refused.value).startswith(message), str(refused.value)


def test_db_export_refuses_arguments_of_the_wrong_kind(tmp_path: Path) -> None:
    with pytest.raises(db.ExportError, match="run_dir=123 is not a run folder's path"):
        db.export(123)
    with pytest.raises(db.ExportError, match=r"is not a dynabatch.Task \(a 'file.py:attr' spec is task_spec=\)"):
        db.export(tmp_path, task="tests/tasks/blobs.py:task")


def test_export_to_a_folder_is_refused_in_one_line_before_reading_the_run(tmp_path: Path) -> None:
    done = subprocess.run(
        command_line("export", [str(tmp_path / "no-run"), "--out", str(tmp_path)]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        env=child_env(),
    )
    assert (done.returncode, done.stderr) == (
        2,
        "usage: dynabatch export RUN_DIR [flags]   (--help lists them)\n"
        f"dynabatch export: error: --out {tmp_path} is a folder: name the "
        f"file to write, e.g. --out {tmp_path / 'model.pt'}\n",
    )


@pytest.mark.slow
def test_export_to_a_path_it_cannot_write_is_one_line_and_leaves_nothing(trained: db.Run, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "model.pt"
    done = subprocess.run(
        command_line("export", [str(trained.dir), "--out", str(out)]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env=child_env(),
    )
    assert (done.returncode, done.stderr) == (2, f"dynabatch export: --out {out}: cannot write it: File exists\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.slow
def test_a_run_made_with_a_relative_task_path_exports_from_another_folder(tmp_path: Path) -> None:
    """The run folder names its task by absolute path: export needs neither the run's folder nor its --task."""
    run = RunProcess(
        tmp_path / "runs",
        tmp_path / "run.err",
        [
            "--task",
            "tasks/blobs.py:task",
            "--workers",
            "1",
            "--slowdowns",
            "1",
            "--no-evaluator",
            "--epochs",
            "1000",
            "--timeout-s",
            "200",
            "--checkpoint-interval-s",
            "1",  # the first checkpoint is what the test waits for (30 s at the default)
        ],
        cwd=TASKS.parent,
    )
    try:
        wait_for("the shard's first checkpoint", lambda: (run.dir / "checkpoints" / "shard-0.pt").exists(), 120)
        run.proc.send_signal(signal.SIGINT)
        assert run.end()[0] == 130
    finally:
        run.close()
    assert json.loads((run.dir / "config.json").read_text())["run"]["task"] == f"{TASKS / 'blobs.py'}:task"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        command_line("export", [str(run.dir), "--out", "model.pt"]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env=child_env(),
        cwd=elsewhere,
    )
    assert done.returncode == 0, done.stderr
    model = load_task(BLOBS).build_model(0)
    model.load_state_dict(torch.load(elsewhere / "model.pt", weights_only=True))


def test_a_run_under_protocol_auto_is_read_as_recorded(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"job": asdict(JobConfig(protocol="auto")), "run": {}}))
    assert read_run(tmp_path).job.protocol == "auto", "the protocol it chose while it ran is not the model's concern"
    (tmp_path / "config.json").write_text(json.dumps({"job": asdict(JobConfig(protocol="nosuch")), "run": {}}))
    with pytest.raises(db.ExportError, match="protocol"):
        read_run(tmp_path)
