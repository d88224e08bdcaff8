"""How fast a cluster could train at best: the reference every method's time is judged against.

Steps to a target accuracy grow as the batch shrinks: K(B) = K_min (1 + B_noise / B) for staleness-free
sequential SGD at global batch B (the critical-batch model; K_min and B_noise are fitted from measured steps to
target at several batch sizes, `fit_steps_to_target`). So a run at batch B needs K(B) B = K_min (B + B_noise)
samples, however they are computed.

Tyurin and Richtarik ("Optimal time complexities of parallel stochastic optimization methods under a fixed
computation model", NeurIPS 2023) show that with workers of fixed speeds the optimal time uses only the m fastest
workers, m chosen so that adding a slower one no longer pays: calibrated with K(B), each of the m workers giving at
least b samples to every step, T* = K_min min over m of (m b + B_noise) / S_m, S_m the summed speed (samples/s) of
the m fastest. It counts compute alone (no transfers), so it is a lower bound for any method on that cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseScale:
    """K(B) = k_min (1 + b_noise / B): the fewest steps (at an unbounded batch) and the batch that doubles them."""

    k_min: float
    b_noise: float

    def steps(self, batch: float) -> float:
        return self.k_min * (1.0 + self.b_noise / batch)

    def samples(self, batch: float) -> float:
        return self.k_min * (batch + self.b_noise)


def fit_steps_to_target(batches: Sequence[float], steps: Sequence[float]) -> NoiseScale:
    """K_min and B_noise from steps to target measured at several batch sizes: K is linear in 1/B
    (K = K_min + K_min B_noise / B), fitted by least squares. Raises ValueError where the points cannot give a
    positive K_min and a non-negative B_noise (fewer than two batch sizes, or steps that grow with the batch)."""
    if len(batches) != len(steps) or len(set(batches)) < 2:
        raise ValueError(f"fit_steps_to_target: needs steps at two or more batch sizes, got {list(batches)}")
    if any(b <= 0 for b in batches) or any(k <= 0 for k in steps):
        raise ValueError("fit_steps_to_target: batches and steps must be positive")
    xs = [1.0 / b for b in batches]
    mx, my = sum(xs) / len(xs), sum(steps) / len(steps)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, steps, strict=True)) / sum((x - mx) ** 2 for x in xs)
    k_min = my - slope * mx
    if k_min <= 0 or slope < 0:
        raise ValueError(
            f"fit_steps_to_target: steps {list(steps)} at batches {list(batches)} do not fall as "
            f"K_min (1 + B_noise / B) (K_min {k_min:.3g}, K_min B_noise {slope:.3g})"
        )
    return NoiseScale(k_min, slope / k_min)


STUDY_NOISE = NoiseScale(k_min=119.8, b_noise=40.2)
"""K(B) for the study's model, data and target (the MLP on Fashion-MNIST to 80% test accuracy; bench/RESULTS.md
section 10): the default of `dynabatch plan`, whose figures hold for another task only with that task's K(B)."""
PER_WORKER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""The per-worker batches T* is sought over."""


@dataclass(frozen=True)
class Optimum:
    """T* and what attains it: the m fastest workers, each giving `batch` samples to every step."""

    time_s: float
    workers: int
    batch: int


def optimal_time(noise: NoiseScale, speeds: Sequence[float], batch: int = 1) -> Optimum:
    """T* = K_min min over m of (m b + B_noise) / S_m for workers of `speeds` samples/s, each giving `batch`."""
    if not speeds or any(s <= 0 for s in speeds) or batch < 1:
        raise ValueError("optimal_time: needs positive speeds and a batch of at least 1")
    best: Optimum | None = None
    total = 0.0
    for m, speed in enumerate(sorted(speeds, reverse=True), start=1):
        total += speed
        t = noise.k_min * (m * batch + noise.b_noise) / total
        if best is None or t < best.time_s:
            best = Optimum(t, m, batch)
    assert best is not None
    return best


@dataclass(frozen=True)
class Device:
    """A worker's step curve and memory: a step of b samples takes fixed_s + per_sample_s b, at most max_batch
    samples (0: none). A GPU's fixed cost is large against its per-sample cost, a CPU's small."""

    fixed_s: float
    per_sample_s: float
    max_batch: int = 0

    def seconds(self, batch: float) -> float:
        return self.fixed_s + self.per_sample_s * batch

    def speed(self, batch: float) -> float:
        """Samples per second at `batch`."""
        return batch / self.seconds(batch)


def calibrated_optimum(noise: NoiseScale, devices: Sequence[Device], batches: Sequence[int]) -> Optimum:
    """T* over the per-worker batches `batches` (a worker's speed depends on its batch through its fixed cost):
    at each b the workers whose cap allows it, and the best of them all."""
    found = [
        optimal_time(noise, [d.speed(b) for d in devices if not d.max_batch or b <= d.max_batch], b)
        for b in batches
        if any(not d.max_batch or b <= d.max_batch for d in devices)
    ]
    if not found:
        raise ValueError(f"calibrated_optimum: no worker can take any of the batches {list(batches)}")
    return min(found, key=lambda o: o.time_s)


def single_machine_time(noise: NoiseScale, global_batch: float, speed: float) -> float:
    """The time of one machine as fast as the whole cluster (`speed` samples/s) training at `global_batch`."""
    return noise.samples(global_batch) / speed
