"""An honest worker with little memory (`--max-batch 1`) among large-batch workers: the job trains as without it.

Issue 22 found that such a worker wrecked the reference job. Two rules were at fault (bench/RESULTS.md 9g): the
shards scaled the rate of a step by the pushed gradient's DBS weight (1/64 for 1 sample of B/n = 64) while the
gradient itself entered the shared momentum buffer at full weight, so every large worker's next step applied the
1-sample noise at full rate; and the gradient bound held every push to the chunk's parameter norm, which honest
1-sample gradients exceed, so the worker was clipped push after push and, in the CNN job, quarantined. Here the
MLP trains half an epoch (3 workers slowed 1x/2x/4x, the fastest at `--max-batch 1`) under the default protocol:
before the fix it ended 2 to 10 points below its clean twin (MARGIN's figures); now within the twins' own spread.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import checkpoint_state, run_job
from tools import need_fashion_mnist

pytestmark = [pytest.mark.slow, pytest.mark.data]

JOB = ["--model", "mlp", "--epochs", "0.5", "--workers", "3", "--slowdowns", "1", "2", "4", "--eval-interval-s", "600"]
# Accuracy after a fixed number of samples, not a time; but the load changes the interleaving of the pushes, and
# with it the accuracy. After a quarter epoch, one job after the other, beside a second copy of the suite the small
# worker's job once ended 6.1 points below its clean twin (77.6% and 83.7%). So the twins train half an epoch, side
# by side under the same load. The small worker's job ended from 3.8 points below to 4.7 above its twin (twelve
# pairs, alone and beside busy processes: the clean twin's own spread, 77.9 to 83.9%, is most of it); with the fix
# reverted (1582552) 1.8 to 5.3 points below (six pairs), and one after the other 5.0 to 10.0 below (three runs).
# Five points lies between.
MARGIN = 0.05


def _run(tmp: Path, name: str, *flags: str) -> tuple[dict, float, str]:
    """(summary, the final model's parameter norm, the shard's log) of a finished job."""
    run, _ = run_job(tmp, name, *JOB, *flags)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    params = checkpoint_state(run / "checkpoints" / "shard-0.pt")["params"]
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in params.values()))
    assert all(bool(torch.isfinite(t).all()) for t in params.values()), f"{name}: non-finite parameters"
    return summary, norm, (run / "logs" / "ps0.log").read_text()


def test_a_worker_with_max_batch_1_trains_with_the_others_as_well_as_without_it(tmp_path):
    need_fashion_mnist()
    with ThreadPoolExecutor(2) as jobs:  # side by side: whatever else the machine runs slows both alike
        twin = jobs.submit(_run, tmp_path, "clean")
        job = jobs.submit(_run, tmp_path, "small", "--max-batches", "1", "0", "0")
        (clean, clean_norm, _), (small, small_norm, shard_log) = twin.result(), job.result()
    print(f"clean {clean['final_test_acc']:.4f} |w| {clean_norm:.3g}; --max-batch 1: {small['final_test_acc']:.4f} "
          f"|w| {small_norm:.3g};", *[line for line in shard_log.splitlines() if "direction scores" in line])
    worker = next(w for w in small["workers"].values() if w["max_batch"] == 1)
    assert worker["final_batch"] == 1 and worker["samples"] > 0 and not worker["left_early"], worker
    assert "quarantined:" not in shard_log, "an honest worker of small batches is not a liar"
    assert small_norm < 2 * clean_norm, f"|w| {small_norm:.3g} against the clean twin's {clean_norm:.3g}"
    assert small["final_test_acc"] >= clean["final_test_acc"] - MARGIN, (small["final_test_acc"],
                                                                          clean["final_test_acc"])
