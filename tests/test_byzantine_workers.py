"""A registered worker whose gradients lie, against a clean twin: the job still trains, its model stays finite.

Three workers train the blobs task (tests/tasks/byzantine.py) with one shard; in
each attacked job one of the three runs a loss that lies (its gradient times 1e3,
noise of about 400 times the honest norm, or its sign flipped). Without the
shards' gradient bound the first two took the model to |w| 1e16 and beyond
(issue 22). The third is never clipped: without the shards' direction check it
was quarantined in none of three runs of this job (which it took to chance in
two of three suite runs before the later stability fixes; a Fashion-MNIST CNN
job it took to 73% against a clean 84-85%). With both, the job finishes with
accuracy within a point or so of the same job with three honest workers, the
final evaluation's loss is finite, and the liar is quarantined, by the check
that sees its lie (counted by the shard, by reason).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness import finish_job, metric_value

pytestmark = pytest.mark.slow

TASK = Path(__file__).resolve().parent / "tasks" / "byzantine.py"
# Under dynamic batches, as these cases were measured. Training starts once all three have joined (--min-workers):
# a liar that joins first trains alone, and with no other worker nothing can tell its gradients lie (it took the
# model to divergence in one of three runs of flipped_large before the honest workers joined).
JOB = [
    "--epochs",
    "6",
    "--global-batch",
    "48",
    "--eval-interval-s",
    "2",
    "--await-final-eval",
    "--liveness-timeout-s",
    "30",
    "--batch-policy",
    "dynamic",
    "--min-workers",
    "3",
]
# The clean twin measured 1.000 in 5 of 5 runs of this job (1000 test samples: one point is 10 samples), and so
# did every attacked job with both defences on. Two points leave room for a loaded machine's timing.
MARGIN = 0.02


def _run(tmp: Path, liar: str) -> tuple[float, float, str]:
    """(final accuracy, final loss, the shard's /metrics) of a job whose third worker runs task `liar`; prints the
    shard's closing line (each worker's direction score, and its lowest once it could be quarantined)."""
    st, metrics, shard = finish_job(
        tmp, JOB, [f"{TASK}:{variant}" for variant in ("honest", "honest", liar)], f"{TASK}:honest"
    )
    assert st.test_acc is not None and st.test_loss is not None, "a finished job has been evaluated"
    print(
        f"{liar}: accuracy {st.test_acc:.4f}, final loss {st.test_loss:.4g};",
        *[line for line in shard.log_since_start().splitlines() if "direction scores" in line],
    )
    return st.test_acc, st.test_loss, metrics


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> float:
    acc, loss, metrics = _run(tmp_path_factory.mktemp("twin"), "honest")
    assert acc > 0.8 and math.isfinite(loss)
    assert metric_value(metrics, "dynabatch_ps_quarantined_workers_total", shard="0") == 0, "an honest worker"
    return acc


# How each liar is caught: by the norm bound (ps/gradient_bounds.py) or the direction check (gradient_direction.py).
# Without the direction check a flipped liar of honest size was quarantined in none of three runs of this job, and
# flipped_large by the norm bound in two of three, only once its climb had made every gradient large; with both
# on, whichever check sees it first quarantines it. The direction check needs 16 scored pushes against honest
# workers that have pushed 4 times each; until it can vouch for a worker, that worker's pushes are held once it is
# 8 taken pushes ahead of the slowest other, so a liar whose honest peers the loaded machine starves at the start
# no longer climbs freely meanwhile (it took the model to a blow-up in some runs before; bench/RESULTS.md 9g).
@pytest.mark.parametrize(
    "liar, reasons",
    [
        ("scaled", ["norm"]),
        ("noise", ["norm"]),
        ("flipped", ["direction", "norm"]),
        ("flipped_large", ["direction", "norm"]),
    ],
)
def test_a_lying_worker_is_quarantined_and_the_job_ends_within_a_point_of_its_clean_twin(
    tmp_path: Path, twin: float, liar: str, reasons: list[str]
) -> None:
    acc, loss, metrics = _run(tmp_path, liar)
    assert math.isfinite(loss), f"{liar}: the final model's loss is {loss}"
    assert acc >= twin - MARGIN, f"{liar}: {acc:.3f} against the clean twin's {twin:.3f}"
    assert metric_value(metrics, "dynabatch_ps_quarantined_workers_total", shard="0") == 1
    caught = sum(
        metric_value(metrics, "dynabatch_ps_quarantined_workers_total", shard="0", reason=reason) for reason in reasons
    )
    assert caught == 1, f"{liar}: quarantined, but not by {' or '.join(reasons)}"
