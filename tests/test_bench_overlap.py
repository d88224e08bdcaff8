"""bench/overlap.py's pure parts: what a --tasks entry means, which variants a protocol refuses, the table."""

from __future__ import annotations

import pytest

from bench.convergence import RunResult
from bench.overlap import BUILTIN, Breakdown, VariantRun, Workload, parse_workload, refusal, table


def test_a_task_entry_carries_its_environment_knobs_and_a_label_naming_them() -> None:
    w = parse_workload("examples/resnet18_cifar10.py:task@RESNET_WIDTH=16,RESNET_SYNTHETIC=2000")
    assert w == Workload(
        "resnet18_cifar10 RESNET_WIDTH=16 RESNET_SYNTHETIC=2000",
        "examples/resnet18_cifar10.py:task",
        (("RESNET_WIDTH", "16"), ("RESNET_SYNTHETIC", "2000")),
    )
    assert "/" not in w.folder and " " not in w.folder
    assert parse_workload("pkg.tasks:mnist") == Workload("pkg.tasks", "pkg.tasks:mnist")
    assert parse_workload(BUILTIN) == Workload(BUILTIN)


@pytest.mark.parametrize("spec", ["resnet", "examples/resnet18_cifar10.py:task@RESNET_WIDTH", "x.py:t@=3"])
def test_a_malformed_task_entry_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(ValueError, match="is not KEY=VALUE|a workload is"):
        parse_workload(spec)


def test_the_config_decides_which_variants_a_protocol_takes() -> None:
    assert refusal("pipeline", "ssgd") == ""
    assert refusal("prefetch+behind", "softsync") == ""
    assert "--prefetch-pull: protocol ssgd" in refusal("prefetch+behind", "ssgd")


def test_the_table_names_the_workload_and_the_accuracy_and_reports_a_failed_run() -> None:
    ok = RunResult(
        "heterogeneous",
        "asgd",
        "dynamic",
        0,
        [],
        ok=True,
        samples_per_s=143.0,
        fraction_of_compute=0.952,
        staleness_mean=2.27,
        final_test_acc=0.103,
    )
    failed = RunResult("heterogeneous", "ssgd", "dynamic", 0, [], ok=False, error="exit 1")
    idle = RunResult("heterogeneous", "softsync", "dynamic", 0, [], ok=True, samples_per_s=0.0)
    text = table(
        [
            VariantRun("pipeline", ok, Breakdown(0.952, 0.009, 0.005, 0.0, 0.004, 0.005), "resnet w16"),
            VariantRun("push+pull", failed, None, "cnn"),
            VariantRun("pipeline", idle, None, "cnn"),
        ]
    )
    assert "| resnet w16 | asgd+dynamic (DBS-SGD) | pipeline | 0 | 143 | 95.2% | 2.27 | 10.3% | 0.9% | 0.5% |" in text
    assert "| cnn | ssgd+dynamic (LB-BSP) | push+pull | 0 | FAILED: exit 1 |" in text
    assert "| cnn | softsync+dynamic | pipeline | 0 | 0 | 0.0% | – | – |" in text, "a run that trained nothing"
