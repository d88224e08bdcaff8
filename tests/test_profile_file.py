"""Clusters described in a file (bench/profile_file.py): the shipped profiles read, bad files are refused by name."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.profile_file import ProfileError, parse_profile, read_profile
from bench.simulate import main
from dynabatch.common.planning.cluster_file import add_group

PROFILES = sorted(Path(__file__).resolve().parent.parent.joinpath("bench", "profiles").glob("*.json"))
GOOD = {
    "workers": [
        {"count": 3, "fixed_s": 0.02, "per_sample_s": 0.001, "max_batch": 64, "link_mbit": 1000},
        {
            "count": 1,
            "fixed_s": 0.002,
            "per_sample_s": 0.004,
            "link_mbit": 10,
            "latency_s": 0.01,
            "join_s": 2.0,
            "leave_s": 5.0,
            "slowdown": "1,2x@1s",
            "source": "a CPU",
        },
    ],
    "model_bytes": 4e6,
    "global_batch": 256,
    "shards": 2,
    "shard_mbit": 5000,
    "name": "four",
    "notes": "n",
}


def test_a_good_file_gives_each_group_its_curve_cap_link_and_times() -> None:
    p = parse_profile(json.dumps(GOOD))
    assert p.name == "four" and len(p.workers) == 4 and p.global_batch == 256
    assert p.sim_settings() == {"wire_bytes": 4e6, "shards": 2, "shard_mbit": 5000.0}
    gpu, cpu = p.workers[0], p.workers[3]
    assert (gpu.fixed_s, gpu.per_sample_s, gpu.max_batch, gpu.link_mbit) == (0.02, 0.001, 64, 1000)
    assert gpu.leave_s == math.inf
    assert (cpu.max_batch, cpu.latency_s, cpu.join_s, cpu.leave_s, cpu.slowdown) == (0, 0.01, 2.0, 5.0, "1,2x@1s")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("workers"), '"workers" must be a non-empty list'),
        (lambda d: d.update(workers=[]), "non-empty list"),
        (lambda d: d.update(shard_rate=3), "unknown field\\(s\\) shard_rate"),
        (lambda d: d["workers"][0].update(per_sample=1), "workers\\[0\\]: unknown field\\(s\\) per_sample"),
        (lambda d: d["workers"][1].pop("link_mbit"), "workers\\[1\\]: missing link_mbit"),
        (lambda d: d["workers"][0].update(count=0), "count must be >= 1"),
        (lambda d: d["workers"][0].update(count=2.5), "count must be an integer"),
        (lambda d: d["workers"][0].update(per_sample_s=0), "per_sample_s must be > 0"),
        (lambda d: d["workers"][0].update(fixed_s="fast"), "fixed_s must be a number"),
        (lambda d: d["workers"][0].update(link_mbit=float("nan")), "link_mbit must be a number"),
        (lambda d: d["workers"][1].update(leave_s=1.0), "leave_s must be > 2"),
        (lambda d: d["workers"][1].update(slowdown="0.5"), "below 1"),
        (lambda d: d.update(shards=0), "shards must be >= 1"),
        (lambda d: d.update(name=3), "name must be text"),
        (lambda d: d["workers"][0].update(join_s=1.0), "no worker starts at 0"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(change: Callable[[dict[str, Any]], object], message: str) -> None:
    doc = json.loads(json.dumps(GOOD))
    change(doc)
    with pytest.raises(ProfileError, match=message):
        parse_profile(json.dumps(doc), "c.json")


def test_not_json_or_not_an_object_or_no_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="c.json: not JSON"):
        parse_profile("{workers", "c.json")
    with pytest.raises(ProfileError, match="must be a JSON object"):
        parse_profile("[1]", "c.json")
    with pytest.raises(ProfileError, match="cannot read"):
        read_profile(tmp_path / "absent.json")


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_shipped_profile_reads_and_cites_its_source(path: Path) -> None:
    p = read_profile(path)
    assert p.workers and "source" in json.loads(path.read_text())


def test_the_simulator_runs_a_cluster_from_a_file_and_says_why_it_refuses_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "workers": [{"count": 2, "fixed_s": 0.01, "per_sample_s": 0.001, "max_batch": 32, "link_mbit": 1000}],
                "model_bytes": 1e5,
            }
        )
    )
    assert (
        main(
            [
                "--profile-file",
                str(good),
                "--protocol",
                "asgd",
                "--policy",
                "fixed",
                "--seed",
                "1",
                "--budget-s",
                "0.3",
                "--model",
                "mlp",
            ]
        )
        == 0
    )
    assert "good.json (2 workers), seed 1" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"workers": [{"count": 2}]}))
    assert main(["--profile-file", str(bad), "--budget-s", "0.3"]) == 2
    assert "bad.json: workers[0]: missing fixed_s" in capsys.readouterr().err
    for flags, message in (
        (["--protocol", "asgdd"], "argument --protocol: invalid choice: 'asgdd'"),
        (["--policy", "fixd"], "argument --policy: invalid choice: 'fixd'"),
        (["--budget-s", "-1"], "argument --budget-s: -1: give a positive number of seconds"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(["--profile-file", str(good), *flags])
        assert refused.value.code == 2 and message in capsys.readouterr().err, flags
    assert main(["--profile-file", str(good), "--protocol", "auto", "--policy", "auto", "--budget-s", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "auto+auto on " in out and "good.json (2 workers)" in out and "\nauto ran asgd + fixed: " in out, (
        "which method auto ran, and why"
    )


def test_probes_gather_into_one_file_and_a_bad_one_leaves_it_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "probes.json"
    gpu = {"count": 1, "fixed_s": 0.02, "per_sample_s": 0.001, "max_batch": 64, "link_mbit": 1000}
    add_group(path, gpu, {"model_bytes": 4e6, "global_batch": 256})
    cluster = add_group(path, {**gpu, "max_batch": 0, "link_mbit": 100}, {"model_bytes": 9e9, "global_batch": 8})
    assert [(g.device.max_batch, g.link_mbit) for g in cluster.groups] == [(64, 1000), (0, 100)]
    assert (cluster.model_bytes, cluster.global_batch) == (4e6, 256), "the first probe's job fields stay"
    before = path.read_text()
    with pytest.raises(ProfileError, match="workers\\[2\\]: per_sample_s must be > 0"):
        add_group(path, {**gpu, "per_sample_s": 0}, {})
    path.with_name("junk.json").write_text("{workers")
    with pytest.raises(ProfileError, match="junk.json: not JSON"):
        add_group(path.with_name("junk.json"), gpu, {})
    assert path.read_text() == before
