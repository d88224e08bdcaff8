"""`--protocol auto --cluster-profile FILE` (common/planning/auto_protocol.py): the protocol chosen from a cluster
file before the shards start, refused without one (on the command line too: tests/test_cli.py), never sent
unresolved; and a real `dynabatch run` that trains with it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dynabatch.common.config import JobConfig, job_from_dict, to_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.auto_choice import choose
from dynabatch.common.planning.auto_protocol import resolved
from dynabatch.common.planning.cluster_file import read_cluster
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import cluster_of
from dynabatch.common.protocols import refuse_unread_settings
from harness import mlp_job, run_job

PROFILES = sorted((Path(__file__).resolve().parents[1] / "bench" / "profiles").glob("*.json"))
# Two fast workers and one twenty times slower per sample: Ringmaster, which drops the slow worker's stale gradients,
# is predicted fastest (then LB-BSP, whose rounds size the slow worker down).
MIXED = {
    "workers": [
        {"count": 2, "fixed_s": 0.002, "per_sample_s": 0.0001, "link_mbit": 10000},
        {"count": 1, "fixed_s": 0.002, "per_sample_s": 0.002, "link_mbit": 10000},
    ],
    "model_bytes": 500000,
}


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_the_protocol_is_the_predictors_choice_on_the_file_at_the_jobs_batch(path: Path) -> None:
    job = JobConfig(protocol="auto", cluster_profile=str(path), global_batch=512, batch_policy="fixed")
    chosen, why = resolved(job)
    cluster = replace(cluster_of(read_cluster(path), 512, job.chunk_bytes, job.min_batch), global_batch=512)
    expected = choose(cluster, STUDY_NOISE)
    assert chosen.protocol == expected.protocol and chosen.batch_policy == "fixed", why
    assert why.startswith(f"{expected.protocol} ({expected.reason}") and str(path) in why
    assert resolved(chosen) == (chosen, ""), "a given protocol is left alone"
    assert chosen.cluster_profile == "", "the file is read: the scheduler is handed a job of the chosen protocol"
    refuse_unread_settings(chosen)


def test_auto_needs_a_readable_cluster_file_and_is_never_sent_unresolved(tmp_path: Path) -> None:
    JobConfig(protocol="auto").validate()  # without a file: chosen at run time (tests/test_protocol_switch.py)
    with pytest.raises(ConfigError, match="--protocol auto: no protocol it chooses among takes this job"):
        JobConfig(protocol="auto", aggregation="median", prefetch_pull=True).validate()
    bad = tmp_path / "bad.json"
    bad.write_text('{"workers": []}')
    with pytest.raises(ConfigError, match="--cluster-profile: .*bad.json"):
        resolved(JobConfig(protocol="auto", cluster_profile=str(bad)))
    unresolved = to_dict(JobConfig(protocol="auto", cluster_profile=str(bad)))
    with pytest.raises(ConfigError, match="protocol='auto': the scheduler's command resolves it"):
        job_from_dict(unresolved)
    assert job_from_dict(unresolved, allow_auto=True).protocol == "auto"


@pytest.mark.slow
def test_a_real_run_trains_with_the_protocol_auto_chose(tmp_path: Path) -> None:
    profile = tmp_path / "cluster.json"
    profile.write_text(json.dumps(MIXED))
    run, printed = run_job(
        tmp_path,
        "r",
        *mlp_job(0.5, "1", "1", "4"),
        "--global-batch",
        "96",
        "--protocol",
        "auto",
        "--cluster-profile",
        str(profile),
        "--eval-interval-s",
        "600",
    )
    assert "dynabatch run: protocol auto chose ringmaster (ringmaster + fixed: predicted fastest" in printed, printed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["protocol"] == "ringmaster" and summary["batch_policy"] == "auto", summary
