"""An honest worker with little memory (`--max-batch 1`) among large-batch workers: the job trains as without it.

Issue 22 found that such a worker wrecked the reference job. Two rules were at fault (bench/RESULTS.md 9g): the
shards scaled the rate of a step by the pushed gradient's DBS weight (1/64 for 1 sample of B/n = 64) while the
gradient itself entered the shared momentum buffer at full weight, so every large worker's next step applied the
1-sample noise at full rate; and the gradient bound held every push to the chunk's parameter norm, which honest
1-sample gradients exceed, so the worker was clipped push after push and, in the CNN job, quarantined. Here the
MLP trains an epoch under asgd (where this was found; auto could run the twins differently) with 3 workers slowed
1x/2x/4x, the fastest at `--max-batch 1`, beside the same job without it (the 2x and 4x workers): both split B = 192
between the large workers, 96 each, so they take the same steps and the small worker's pushes are all that differs.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import checkpoint_state, run_job
from tools import need_fashion_mnist

pytestmark = [pytest.mark.slow, pytest.mark.data]

JOB = ["--model", "mlp", "--epochs", "1", "--eval-interval-s", "600", "--protocol", "asgd"]
WITH_SMALL = ["--workers", "3", "--slowdowns", "1", "2", "4", "--max-batches", "1", "0", "0"]
WITHOUT = ["--workers", "2", "--slowdowns", "2", "4"]
# Accuracy after a fixed number of samples, not a time; but the load changes the interleaving of the pushes, and
# with it the accuracy, so the twins run side by side under the same load. Against the clean 3-worker job (64
# samples a step each, 1.7 times the steps) the small worker's job lost 6.1 points beside a second suite. Against
# this twin, after an epoch, four jobs at once on 2 cores: from 1.1 points below to 0.7 above (six pairs); with the
# fix reverted (1582552) from 9.5 below to 1.3 above (six pairs: 9.5, 9.1, 5.9, 2.8, 0.3 below, 1.3 above). Half an
# epoch told them apart less well (4.5 below to 2.7 above, against 4.0 to 8.5 below). Beside a second suite the
# fixed rule once ended 5.6 points below (79.0% against 84.6%, the small worker's 1,928 samples 3% of the job's),
# and 0.1 above in the other copy: so seven points, which the reverted rule's worst pairs (and its collapse to 68%
# without the gradient bound) still exceed, not the one-point spread the twins show alone.
MARGIN = 0.07


def _run(tmp: Path, name: str, flags: list[str]) -> tuple[dict[str, Any], float, str]:
    """(summary, the final model's parameter norm, the shard's log) of a finished job."""
    run, _ = run_job(tmp, name, *JOB, *flags)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    params = checkpoint_state(run / "checkpoints" / "shard-0.pt")["params"]
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in params.values()))
    assert all(bool(torch.isfinite(t).all()) for t in params.values()), f"{name}: non-finite parameters"
    return summary, norm, (run / "logs" / "ps0.log").read_text()


def test_a_worker_with_max_batch_1_trains_with_the_others_as_well_as_without_it(tmp_path: Path) -> None:
    need_fashion_mnist()
    with ThreadPoolExecutor(2) as jobs:  # side by side: whatever else the machine runs slows both alike
        twin = jobs.submit(_run, tmp_path, "without", WITHOUT)
        job = jobs.submit(_run, tmp_path, "small", WITH_SMALL)
        (without, without_norm, _), (small, small_norm, shard_log) = twin.result(), job.result()
    print(
        f"without it {without['final_test_acc']:.4f} |w| {without_norm:.3g}; with it (--max-batch 1) "
        f"{small['final_test_acc']:.4f} |w| {small_norm:.3g};",
        *[line for line in shard_log.splitlines() if "direction scores" in line],
    )
    worker = next(w for w in small["workers"].values() if w["max_batch"] == 1)
    assert worker["final_batch"] == 1 and worker["samples"] > 0 and not worker["left_early"], worker
    assert "quarantined:" not in shard_log, "an honest worker of small batches is not a liar"
    assert small_norm < 2 * without_norm, f"|w| {small_norm:.3g} against the twin's {without_norm:.3g}"
    assert small["final_test_acc"] >= without["final_test_acc"] - MARGIN, (
        small["final_test_acc"],
        without["final_test_acc"],
    )
