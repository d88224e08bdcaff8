"""A registered worker whose gradients lie, against a clean twin: the job still trains, its model stays finite.

Three workers train the blobs task (tests/tasks/byzantine.py) with one shard; in
each attacked job one of the three runs a loss that lies (its gradient times 1e3,
or noise of about 400 times the honest norm; a sign-flipped one is an open hole,
below). Without the shards' gradient bound such a worker took the model to
|w| 1e16 and beyond (issue 22).
With it, the job finishes with accuracy within a point or so of the same job
with three honest workers, the final evaluation's loss is finite, and a worker
whose pushes keep being clipped is quarantined (counted by the shard).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness import Cluster, metric_value

pytestmark = pytest.mark.slow

TASK = Path(__file__).resolve().parent / "tasks" / "byzantine.py"
# Under dynamic batches, as these cases were measured.
JOB = ["--epochs", "6", "--global-batch", "48", "--eval-interval-s", "2", "--await-final-eval",
       "--liveness-timeout-s", "30", "--batch-policy", "dynamic"]
MARGIN = 0.02  # the twin's accuracy is about 0.95 on a 1000-sample test set; one point is 10 samples


def _run(tmp: Path, liar: str) -> tuple[float, float, str]:
    """(final accuracy, final loss, the shard's /metrics) of a job whose third worker runs task `liar`."""
    c = Cluster(tmp, JOB)
    try:
        c.scheduler()
        shard = c.shard(0, None, "--on-finish", "idle")
        for name, variant in (("a", "honest"), ("b", "honest"), ("c", liar)):
            c.worker(name, "--task", f"{TASK}:{variant}")
        c.worker("eval", "--evaluator", "--task", f"{TASK}:honest")
        st = c.wait_status("the job to finish", lambda s: s.finished, 300)
        return st.test_acc, st.test_loss, shard.metrics()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> float:
    acc, loss, _ = _run(tmp_path_factory.mktemp("twin"), "honest")
    assert acc > 0.8 and math.isfinite(loss)
    return acc


# Not asserted: a sign-flipped liar ("flipped" in tests/tasks/byzantine.py). A flipped gradient of honest size is
# never clipped and under asgd nothing bounds how often it is pushed; on the merged code it took this job to 10.7%
# in two of three suite runs and was held within a point in the third (an open hole of issue 22, documented in
# docs/operators.md).
@pytest.mark.parametrize("liar, quarantined", [("scaled", True), ("noise", True)])
def test_a_lying_worker_leaves_the_job_within_a_point_of_its_clean_twin(tmp_path, twin, liar, quarantined):
    acc, loss, metrics = _run(tmp_path, liar)
    print(f"{liar}: accuracy {acc:.4f} (clean twin {twin:.4f}), final loss {loss:.4g}")
    assert math.isfinite(loss), f"{liar}: the final model's loss is {loss}"
    assert acc >= twin - MARGIN, f"{liar}: {acc:.3f} against the clean twin's {twin:.3f}"
    if quarantined:
        assert metric_value(metrics, "dynabatch_ps_quarantined_workers_total", shard="0") == 1
