"""`dynabatch plan`: a measured cluster (a cluster file, a run folder, machines' probes saved by `dynabatch check
--save-profile`) in, each method's predicted time to target against T* and the chosen method out, with a plot;
a cluster that cannot be read is refused with exit 2 and nothing written."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from dynabatch.cluster.plan_command import main
from dynabatch.cluster.report import Snapshot, write_timeline
from dynabatch.cluster.run_profile import measured_worker, read_run
from dynabatch.common.config import JobConfig
from dynabatch.common.planning.cluster_file import WorkerGroup
from dynabatch.common.planning.prediction import POLICIES, PROTOCOLS
from dynabatch.common.wire.messages import JobStatus, WorkerStatus
from dynabatch.common.wire.step_times import StepTimes
from hang_guard import hang_guard_s
from harness import child_env, command_line, mlp_job, run_job

PROFILES = Path(__file__).resolve().parent.parent / "bench" / "profiles"
PNG = b"\x89PNG\r\n\x1a\n"


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main([*args, "--json"]) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    return plan


def test_plan_of_a_cluster_file_prints_every_method_against_t_star_and_draws_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "p.png"
    assert main(["--profile", str(PROFILES / "mixed_gpus16.json"), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "16 workers at the start" in text and "T* = " in text and "chosen: " in text
    for protocol in PROTOCOLS:
        for policy in POLICIES:
            assert f"{protocol} + {policy}" in text
    assert {"ringmaster", "local"} <= set(PROTOCOLS) and "stale" in text and "start-up s" in text
    assert plot.read_bytes()[:8] == PNG
    report = _plan(capsys, "--profile", str(PROFILES / "mixed_gpus16.json"), "--plot", str(plot))
    assert {
        "cluster",
        "workers",
        "global_batch",
        "optimum",
        "methods",
        "chosen",
        "not_modelled",
        "nodes",
        "notes",
        "plot",
    } <= set(report)
    assert report["workers"] == 16 and report["global_batch"] == 2048
    times = [m["time_s"] for m in report["methods"]]
    assert times == sorted(times) and len(times) == len(PROTOCOLS) * len(POLICIES)
    assert all(m["ratio_to_optimum"] >= 1 for m in report["methods"])
    best = report["methods"][0]
    assert (report["chosen"]["protocol"], report["chosen"]["policy"]) == (best["protocol"], best["policy"])
    # auto at run time leaves Ringmaster out (protocol_switch.py SWITCHABLE): plan says what it would run there
    at_run = report["chosen_at_run_time"]
    switchable = [m for m in report["methods"] if m["protocol"] in at_run["among"] and m["protocol"] != "ringmaster"]
    assert best["protocol"] == "ringmaster" and "ringmaster" not in at_run["among"]
    assert (at_run["protocol"], at_run["policy"]) == (switchable[0]["protocol"], switchable[0]["policy"])
    assert f"chosen at run time (--protocol auto alone, among {', '.join(at_run['among'])})" in text
    assert "msd" in report["not_modelled"] and not {"asgd", "ringmaster", "local"} & set(report["not_modelled"])
    by_name = {(m["protocol"], m["policy"]): m for m in report["methods"]}
    ring = by_name["ringmaster", "fixed"]
    assert ring["batches"][-4:] == [0] * 4 and min(ring["batches"][:-4]) > 0, "Ringmaster would discard the T4s': idle"
    assert ring["discarded"] < by_name["asgd", "fixed"]["discarded"], "the idle T4s compute nothing to discard"
    asgd = by_name["asgd", "fixed"]
    assert asgd["startup_s"] == 0 and 0 < asgd["staleness"] < 15, "asgd counts the updates that pay, below n - 1"
    assert asgd["discarded"] > 0, "the T4s' updates, the stalest, are counted as worth nothing"
    # K(B) is the task's: a larger B_noise makes every method need more samples
    noisier = _plan(capsys, "--profile", str(PROFILES / "mixed_gpus16.json"), "--plot", str(plot), "--b-noise", "400")
    assert noisier["optimum"]["time_s"] > report["optimum"]["time_s"]


def test_a_file_without_model_bytes_moves_the_jobs_model_over_its_links_and_the_global_batch_flag_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the simulator does: a file's links count with the job's --model on them, and --global-batch (set) is the
    job's B over the file's."""

    def planned(link_mbit: float, *flags: str) -> dict[str, Any]:
        path = tmp_path / f"c{link_mbit}.json"
        slow = {"count": 1, "fixed_s": 0.01, "per_sample_s": 0.002, "max_batch": 0, "link_mbit": link_mbit}
        fast = {"count": 4, "fixed_s": 0.02, "per_sample_s": 0.0005, "max_batch": 0, "link_mbit": 10000}
        path.write_text(json.dumps({"workers": [fast, slow], "global_batch": 640}))
        return _plan(capsys, "--profile", str(path), "--plot", str(tmp_path / "p.png"), *flags)

    fast, slow = planned(10000, "--model", "mlp"), planned(1, "--model", "mlp")
    assert fast["model_bytes"] == slow["model_bytes"] > 0 and "--model mlp" in " ".join(fast["notes"])
    time = {
        name: {(m["protocol"], m["policy"]): m["time_s"] for m in r["methods"]}
        for name, r in (("fast", fast), ("slow", slow))
    }
    assert time["slow"]["ssgd", "fixed"] > 2 * time["fast"]["ssgd", "fixed"], "a round waits for the 1 Mbit/s link"
    assert fast["global_batch"] == 640
    given = planned(10000, "--global-batch", "64")
    assert given["global_batch"] == 64 and any("--global-batch" in n for n in given["notes"])
    at_default = planned(10000, "--global-batch", "192")
    assert at_default["global_batch"] == 192, "a flag given at its default value wins too"
    assert given["model_bytes"] != fast["model_bytes"] and "--model cnn" in " ".join(given["notes"]), (
        "the job's default model, the CNN"
    )


def test_a_run_folders_worker_seen_at_one_batch_takes_its_fixed_cost_from_its_start_up_probe() -> None:
    """Under the fixed policy a worker's steps are all of one batch, which cannot tell its fixed cost from its
    per-sample cost: its probe's fixed fraction, as the scheduler reads it, splits them; without a probe its whole
    step counts per sample, and both say so."""

    def worker(sps: float, fixed_s: float, batches: tuple[int, ...] = (64,)) -> tuple[WorkerGroup, str | None]:
        timeline = [
            JobStatus(
                t=float(i),
                workers={
                    "w0": WorkerStatus(
                        name="gpu",
                        steps=i,
                        batch=batches[i % len(batches)],
                        times=StepTimes(compute_s=0.05, pull_s=0.001, push_s=0.001),
                        standalone_sps=sps,
                        standalone_fixed_s=fixed_s,
                    )
                },
            )
            for i in range(1, 6)
        ]
        return measured_worker("w0", timeline, 4e5, 1024)

    probed, note = worker(1280.0, 0.025)  # the probe: 50 ms at 64 samples, half of it fixed
    assert probed.device.fixed_s == pytest.approx(0.025) and probed.device.per_sample_s == pytest.approx(0.025 / 64)
    assert note == "gpu: its steps were of one batch size (64); its fixed cost is its start-up probe's"
    _, note = worker(1280.0, 0.025, (40, 72))  # a dynamic split's batches, whose times moved with the load alone
    assert note == (
        "gpu: its steps' times do not resolve a fixed cost (batches seen: 40, 72); its fixed cost is its start-up "
        "probe's"
    )
    guessed, note = worker(0.0, 0.0)
    assert guessed.device.fixed_s == 0 and guessed.device.per_sample_s == pytest.approx(0.05 / 64)
    assert note is not None and "counted as per-sample" in note


def test_a_run_folders_model_bytes_count_a_local_rounds_one_pull_and_push_per_h_steps(tmp_path: Path) -> None:
    """Under local SGD (H = 4) two workers of 16 steps each moved the model 8 times each (a push and a pull a
    round), after 2 steps each under asgd, which moved it 4 times each: counted as two transfers a step, the model
    came out 3 times too small (8 under local alone), and every link with it."""
    model = 10_000

    def status(t: float, steps: int, protocol: str, moved: int) -> JobStatus:
        workers = {
            f"w{i}": WorkerStatus(name=f"worker{i}", steps=steps, batch=32, times=StepTimes(compute_s=0.01))
            for i in (0, 1)
        }
        return JobStatus(t=t, workers=workers, protocol=protocol, local_steps=4, bytes=moved * model)

    (tmp_path / "config.json").write_text(json.dumps({"job": asdict(JobConfig(local_steps=4))}))
    write_timeline(tmp_path, [Snapshot(status(1.0, 2, "asgd", 8), 1.0), Snapshot(status(2.0, 18, "local", 24), 2.0)])
    assert read_run(tmp_path).cluster.model_bytes == pytest.approx(model)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{workers", "not JSON"),
        ('{"workers": [{"count": 2}]}', "workers\\[0\\]: missing fixed_s"),
        (
            '{"workers": [{"count": 1, "fixed_s": 0.1, "per_sample_s": 0.01, "link_mbit": 10}], "shard_rate": 1}',
            "unknown field\\(s\\) shard_rate",
        ),
    ],
)
def test_a_bad_cluster_file_is_refused_with_exit_2_naming_why_and_nothing_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    bad, plot = tmp_path / "bad.json", tmp_path / "p.png"
    bad.write_text(text)
    assert main(["--profile", str(bad), "--plot", str(plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dynabatch plan: {bad}") and re.search(message, err), err
    assert not plot.exists()
    assert main([str(tmp_path), "--plot", str(plot)]) == 2  # a folder that holds no run
    assert "not a run folder written by dynabatch run" in capsys.readouterr().err
    assert main([str(bad), "--plot", str(plot)]) == 2  # the file given where a run folder goes
    assert "a cluster file is read with --profile FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # neither a run folder nor a file: the usage error's exit 2
        main([])
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:  # every method is planned: a protocol flag would be ignored
        main(["--profile", str(PROFILES / "mixed_gpus16.json"), "--protocol", "asgd"])
    assert exited.value.code == 2 and "unrecognized arguments: --protocol" in capsys.readouterr().err


def test_check_save_profile_gathers_machines_into_a_file_plan_reads_and_a_run_folder_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two probes of this machine as two workers (one with a memory cap), then a short real run of the MLP and
    the plan of its folder: the model's bytes the run's traffic implies agree with those the probe counted."""
    probes = tmp_path / "probes.json"
    for link, cap in (("1000", "64"), ("100", "0")):
        done = subprocess.run(
            command_line(
                "check",
                [
                    "--dataset",
                    "synthetic",
                    "--model",
                    "mlp",
                    "--batches",  # a slope the fastest of 20 steps resolves beside a second suite's load
                    "16",
                    "1024",
                    "--repeats",
                    "20",
                    "--save-profile",
                    str(probes),
                    "--link-mbit",
                    link,
                    "--device-max-batch",
                    cap,
                ],
            ),
            capture_output=True,
            text=True,
            timeout=hang_guard_s(120),
            env=child_env(),
        )
        assert done.returncode == 0, done.stderr
    saved = json.loads(probes.read_text())
    assert [(g["link_mbit"], g["max_batch"]) for g in saved["workers"]] == [(1000, 64), (100, 0)]
    report = _plan(capsys, "--profile", str(probes))
    assert report["workers"] == 2 and report["global_batch"] == 192
    assert [n["max_batch"] for n in report["nodes"]] == [64, 0]
    assert all(b <= 64 for m in report["methods"] for b in m["batches"][:1])
    assert Path(report["plot"]) == probes.with_suffix(".plan.png") and probes.with_suffix(".plan.png").exists()

    run, _ = run_job(
        tmp_path,
        "r",
        *mlp_job(1, "1", "2"),
        "--protocol",
        "asgd",
        "--batch-policy",
        "dynamic",
        "--global-batch",
        "96",
        "--status-s",
        "0.1",
    )
    planned = _plan(capsys, str(run))
    assert planned["workers"] == 2 and planned["global_batch"] == 96, "planned at the B it ran with"
    at_default = _plan(capsys, str(run), "--global-batch", "192")
    assert at_default["global_batch"] == 192 and any("--global-batch" in n for n in at_default["notes"])
    assert all(m["ratio_to_optimum"] >= 1 for m in planned["methods"])
    assert (run / "plan.png").read_bytes()[:8] == PNG
    # the job's bytes over its steps' pulls and pushes and its evaluations' pulls: the model's, but for the pulls
    # in flight (at most one per worker, against the hundred-odd steps this run takes)
    assert planned["model_bytes"] == pytest.approx(saved["model_bytes"], rel=0.1)
    assert any("service rate was not measured" in n for n in planned["notes"])
