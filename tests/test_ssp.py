"""Stale-synchronous parallel end to end: the staleness bound holds, and a loose bound is asgd.

Two workers with fixed batches, one four times slower than the other: under asgd
the slow worker's gradients arrive several versions stale. With --staleness 0 no
worker may pull a step ahead of the other, so between a worker's pull and its push
only the other worker can have pushed, once: no update is more than 1 version
stale. With a bound far beyond the run's length nothing is ever held back. (That
ssp learns is checked with the other protocols in test_run.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynabatch.common import staleness
from harness import run_job

pytestmark = pytest.mark.slow

FLAGS = (
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--epochs",
    "0.5",
    "--workers",
    "2",
    "--slowdowns",
    "1",
    "4",
    "--batch-policy",
    "fixed",
    "--protocol",
    "ssp",
)


def _staleness(tmp_path: Path, bound: int) -> tuple[staleness.StalenessStats, list[int]]:
    """The run's staleness statistics and its counts by staleness (index k: updates k versions stale)."""
    run, _ = run_job(tmp_path, f"s{bound}", *FLAGS, "--staleness", str(bound))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    counts = json.loads((run / "timeline.json").read_text())[-1]["staleness"]
    while counts and not counts[-1]:
        counts.pop()
    return staleness.stats(counts), counts


def test_ssp_bound_zero_keeps_every_update_within_one_version_and_a_loose_bound_is_asgd(tmp_path: Path) -> None:
    tight, tight_counts = _staleness(tmp_path, 0)
    assert tight.updates > 0 and len(tight_counts) <= 2, f"s=0 allows staleness 1 at most: {tight_counts}"
    loose, loose_counts = _staleness(tmp_path, 10_000)
    assert len(loose_counts) > 2, f"the 4x worker's gradients should be several versions stale: {loose_counts}"
    assert loose.mean is not None and tight.mean is not None and loose.mean > tight.mean
