"""The protocol table: every spec names a shard rule and a worker loop that exist, and no role
compares a protocol's name (the spec is the one place a protocol is described)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError, add_flags, from_args
from dynabatch.common.protocols import (
    DELTA,
    GRADIENT,
    PROTOCOLS,
    SPECS,
    MsyncSettings,
    OuterSettings,
    ProtocolSettings,
    SoftsyncSettings,
    SspSettings,
    protocol_settings,
    protocol_spec,
)
from dynabatch.common.wire.chunking import make_layout
from dynabatch.optim import SGD
from dynabatch.ps.protocol_rules import RULES
from dynabatch.ps.shard_state import ShardState
from dynabatch.worker.loops import LOOPS
from harness import run_job, trained_its_epochs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_spec_names_a_shard_rule_and_a_worker_loop_that_exist(name: str) -> None:
    spec = protocol_spec(name)
    assert spec.shard_rule in RULES and spec.worker_loop in LOOPS
    assert spec.push_kind in (GRADIENT, DELTA)
    assert spec.local_steps == (spec.push_kind == DELTA), "local steps are what make a delta"
    JobConfig(protocol=name).validate()


def test_every_rule_and_loop_serves_some_protocol() -> None:
    assert {s.shard_rule for s in SPECS.values()} == set(RULES)
    assert {s.worker_loop for s in SPECS.values()} == set(LOOPS)


def test_an_unknown_protocol_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown protocol 'bsp'.*asgd"):
        protocol_spec("bsp")
    with pytest.raises(ConfigError, match="--protocol"):
        JobConfig(protocol="bsp").validate()


def test_no_role_compares_a_protocols_name() -> None:
    """`protocol ==`, `protocol in (...)` or a protocol's name as a string literal outside the table
    (a rule's or loop's `NAME`, which the table refers to, and the flag's default excepted)."""
    names = "|".join(PROTOCOLS)
    compared = re.compile(rf"protocol\s*(==|!=|\bin\b|\bnot in\b)|[\"']({names})[\"']")
    offenders = []
    for folder in ("common", "ps", "worker", "scheduler", "cluster", "cli"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "protocols.py":
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if compared.search(code) and not code.strip().startswith("NAME = ") and "opt(" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", PROTOCOLS)
def test_prefetch_pull_is_taken_only_where_the_spec_allows_it(name: str) -> None:
    """A pull before the worker's own push adds staleness: only protocols that take it may be asked for it."""
    job = JobConfig(protocol=name, prefetch_pull=True)
    if SPECS[name].may_prefetch_pull:
        job.validate()
        with pytest.raises(ConfigError, match="choose one"):
            JobConfig(protocol=name, prefetch_pull=True, pipeline="on").validate()
    else:
        with pytest.raises(ConfigError, match=f"--prefetch-pull: protocol {name} "):
            job.validate()


def test_push_behind_needs_prefetch_pull() -> None:
    with pytest.raises(ConfigError, match="--push-behind needs --prefetch-pull"):
        JobConfig(protocol="asgd", push_behind=True).validate()
    JobConfig(protocol="asgd", push_behind=True, prefetch_pull=True).validate()


@pytest.mark.parametrize("name", PROTOCOLS)
def test_each_protocols_settings_come_from_its_own_flags_and_reach_its_rule(name: str) -> None:
    """The spec names its settings class; the flags (same names as ever) build it; the shard rule holds it."""
    job = JobConfig(
        protocol=name, softsync_n=3, staleness=5, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=False, sync_m=2
    )
    settings = protocol_settings(job)
    assert type(settings) is SPECS[name].settings
    flagged: dict[type[ProtocolSettings], ProtocolSettings] = {
        SoftsyncSettings: SoftsyncSettings(3),
        SspSettings: SspSettings(staleness_bound=5),
        MsyncSettings: MsyncSettings(2),
        OuterSettings: OuterSettings(0.7, 0.9, False),
    }
    expected = flagged.get(type(settings), SPECS[name].settings())
    assert settings == expected
    state = ShardState.initial(make_layout(10, 1024, 1).chunks, torch.zeros(10), SGD(lr=0.1), name, 8, settings)
    assert state.rule.settings is settings
    assert not [f for f in ("outer", "softsync_n", "staleness_bound") if hasattr(state, f)], (
        "a protocol's settings live in its settings object, not on the shard"
    )


def test_a_shard_refuses_another_protocols_settings() -> None:
    with pytest.raises(ValueError, match="protocol softsync takes SoftsyncSettings, not SspSettings"):
        ShardState.initial(make_layout(10, 1024, 1).chunks, torch.zeros(10), SGD(lr=0.1), "softsync", 8, SspSettings(2))


def test_the_protocol_flags_keep_their_names() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, JobConfig, env={})
    job = from_args(
        JobConfig,
        parser.parse_args(
            ["--protocol", "ssp", "--staleness", "7", "--softsync-n", "2", "--outer-lr", "0.5", "--no-outer-nesterov"]
        ),
    )
    assert protocol_settings(job) == SspSettings(7)
    assert OuterSettings.from_job(job) == OuterSettings(0.5, 0.0, False)
    assert SoftsyncSettings.from_job(job) == SoftsyncSettings(2)


FASHION = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.skipif(not FASHION.exists(), reason="apt-get install -y dataset-fashion-mnist")
@pytest.mark.parametrize("protocol, policy", [("ringmaster", "fixed"), ("rennala", "dynamic")])
def test_each_optimal_time_protocol_trains_in_a_real_run(tmp_path: Path, protocol: str, policy: str) -> None:
    """As tests/test_run.py's pairs (the MLP for a quarter epoch, the final model evaluated), with three workers,
    one 4x slower. Under ringmaster with fixed batches (R = 3 live workers) the slow worker's gradients are
    about 2 x 4 = 8 versions stale, so some are discarded: counted, and its worker goes on without backing off."""
    run, _ = run_job(
        tmp_path,
        "r",
        "--model",
        "mlp",
        "--epochs",
        "0.25",
        "--workers",
        "3",
        "--slowdowns",
        "1",
        "1",
        "4",
        "--protocol",
        protocol,
        "--batch-policy",
        policy,
        "--eval-interval-s",
        "600",
    )
    summary = trained_its_epochs(run)
    assert summary["final_eval"] and summary["protocol"] == protocol
    shown = {k: summary[k] for k in ("final_test_acc", "discarded", "updates", "samples", "staleness_mean")}
    assert summary["final_test_acc"] > 0.60, (shown, summary["workers"])
    if protocol == "ringmaster":
        assert summary["discarded"] > 0, summary
        slow = next(w for w in summary["workers"].values() if w["name"] == "worker2")
        assert slow["samples"] > 0, "the slow worker's gradients are not all discarded"
    worker_logs = "".join(log.read_text() for log in (run / "logs").glob("worker*.log"))
    assert "step failed" not in worker_logs, "a discarded gradient is not an error"


@pytest.mark.slow
def test_msync_trains_on_the_fastest_m_and_drops_the_slow_workers_gradients(tmp_path: Path) -> None:
    """m = 2 of three workers, one 16x slower, fixed batches: a round closes on the first two gradients computed at
    its model, so the slow worker's, late, are the ones discarded (counted, not errors), and it trains at its own
    pace where ssgd's rounds would wait for it; the job still ends at its epochs, counted from the samples taken.
    The slowdown emulates compute alone, and the MLP's step is mostly transfers, so load compresses it: beside a
    second suite at load 14 the 16x worker's step was 1.3x the others' (its samples 0.59 of theirs). What is
    judged is what msync does with whatever the slow worker's pace is: its steps are the ones dropped, and it
    trains fewer samples than either fast worker."""
    run, _ = run_job(
        tmp_path,
        "r",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--global-batch",
        "384",
        "--workers",
        "3",
        "--slowdowns",
        "1",
        "1",
        "16",
        "--protocol",
        "msync",
        "--sync-m",
        "2",
        "--batch-policy",
        "fixed",
        "--eval-interval-s",
        "600",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["protocol"] == "msync" and summary["epochs"] >= 1, summary
    workers = {w["name"]: w for w in summary["workers"].values()}
    samples = {name: w["samples"] for name, w in workers.items()}
    # a worker's samples are its applied steps' (128 each); its discarded steps are counted apart
    dropped = {name: w["discarded"] / (w["discarded"] + w["samples"] // 128) for name, w in workers.items()}
    assert summary["discarded"] > 0, summary
    assert dropped["worker2"] > max(dropped["worker0"], dropped["worker1"]), (dropped, samples)
    # Rounds that waited for the 16x worker (ssgd's) would give the three the same samples.
    assert samples["worker2"] < min(samples["worker0"], samples["worker1"]), samples
    worker_logs = "".join(log.read_text() for log in (run / "logs").glob("worker*.log"))
    assert "step failed" not in worker_logs, "a discarded gradient is not an error"


def test_an_m_above_the_starting_workers_is_refused() -> None:
    JobConfig(protocol="msync", sync_m=3, min_workers=3).validate()
    with pytest.raises(ConfigError, match="--sync-m 4: a round takes the first m gradients"):
        JobConfig(protocol="msync", sync_m=4, min_workers=3).validate()


def test_msync_takes_a_workers_gradient_whole_never_pipelined() -> None:
    """Its round chooses workers by their first push: a step pushed chunk by chunk would be chosen on some chunks
    and discarded on others, and the next pull would mix two rounds' chunks."""
    assert not JobConfig(protocol="msync").pipelines(chunks=10)
    assert JobConfig(protocol="ssgd").pipelines(chunks=10)
    with pytest.raises(ConfigError, match="--pipeline on: protocol msync takes a worker's gradient whole"):
        JobConfig(protocol="msync", pipeline="on").validate()


def test_every_settings_flag_is_a_job_field_named_once() -> None:
    """Each flag is declared by one settings class; RoundSettings' are shared by inheritance, not named again."""
    classes = {cls for s in SPECS.values() for cls in s.settings.__mro__ if issubclass(cls, ProtocolSettings)}
    inherited = {cls: getattr(cls.__mro__[1], "FLAGS", ()) for cls in classes}
    flags = [flag for cls in classes for flag in cls.FLAGS if flag not in inherited[cls]]
    assert len(flags) == len(set(flags)), "a flag belongs to one protocol's settings"
    assert all(set(inherited[cls]) <= set(cls.FLAGS) for cls in classes)
    assert set(flags) <= {f.name for f in dataclasses.fields(JobConfig)}
    assert "max_delay" in flags
