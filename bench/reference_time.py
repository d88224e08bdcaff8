"""T* of a simulated cluster: how fast the study's training could reach its target there at best
(common/planning/optimum.py).

The calibration is the study's own: K(B) of staleness-free sequential SGD with the MLP on Fashion-MNIST to 80%
test accuracy, momentum 0, each B at its best step size (bench/steps_to_target.py; bench/RESULTS.md section 10
has the measurement and the command). A worker's speed is its own step curve (bench/simulate.py's WorkerSpec: its
curve, or the cluster's times its first slowdown) under its cap; workers that join later are left out (T* of the
cluster that starts). T* counts compute alone, so it is a lower bound on any method's time.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.simulate import WorkerSpec
from dynabatch.common.planning.optimum import (
    PER_WORKER_BATCHES,
    STUDY_NOISE,
    Device,
    NoiseScale,
    Optimum,
    calibrated_optimum,
)
from dynabatch.common.slowdown import Slowdown

STUDY_SETTING = ("mlp", "fashion-mnist", "0.80")
"""The model, data and target STUDY_NOISE was measured for: T* of any other setting is unknown."""


def device_of(spec: WorkerSpec, fixed_s: float, per_sample_s: float) -> Device:
    """A simulated worker's step curve at its first slowdown, and its cap."""
    slowdown, own = Slowdown.parse(spec.slowdown), spec.device(fixed_s, per_sample_s)
    factor = slowdown.factor(0.0)
    return Device(own.fixed_s * factor + slowdown.fixed_s(0.0), own.per_sample_s * factor, own.max_batch)


def cluster_optimum(
    workers: Sequence[WorkerSpec], fixed_s: float, per_sample_s: float, noise: NoiseScale = STUDY_NOISE
) -> Optimum:
    """T* of the workers that start, each at `fixed_s + per_sample_s * b` times its slowdown unless it has its own
    curve, over per-worker batches that are powers of two up to 1024."""
    starters = [device_of(w, fixed_s, per_sample_s) for w in workers if w.join_s == 0]
    return calibrated_optimum(noise, starters, PER_WORKER_BATCHES)
