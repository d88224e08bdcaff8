"""A method's time to target on a measured cluster, predicted without running it: what `dynabatch plan` prints and
what `--protocol auto` / `--batch-policy auto` choose by (common/planning/auto_choice.py).

The model, each part a stated assumption:

- The cluster (common/planning/predicted_cluster.py): each worker's step curve, cap and link, the shards' service
  rate, the model's bytes; a step's compute pipelined with its transfers.
- The batch policy gives each worker its batch (POLICIES): `fixed` B/n each, a capped worker held at its cap and
  the rest shared by the others (scheduler/batch_allocation.py's water-filling); `dynamic` equal steps (a local SGD
  round: H steps and its transfers) under the caps where a slower step costs the others (ProtocolSpec.equal_steps),
  no batch for a worker whose transfers alone outlast the step only where a sized round may leave it out (ssgd);
  else batches in proportion to compute speed (DBS-SGD); a worker that holds a batch holds at least the job's
  --min-batch (`Cluster.min_batch`), as the scheduler gives it.
- The protocol turns steps into updates (common/planning/protocol_models.py `MODELS`: asgd, ssgd, ringmaster,
  local): samples per second, the samples an update is worth (its effective batch, stale updates worth less) and
  a first round at the fixed split for the protocols that wait for rounds.
- K(B) = K_min (1 + B_noise / B) steps to target at batch B, so the samples to target at an update's effective
  batch b are K_min (b + B_noise), and the time is the start-up plus those samples over the samples per second.

Not modelled: speed shifts, joins and leaves (the cluster as it starts), msync, msd, ssp, rennala, softsync and
the delay-scaled step, divergence at a too-large step size, and T*'s own limit (it counts compute only). No
prediction falls below T* on the shipped cluster files, the built-in profiles and random clusters
(tests/test_prediction.py). Beside the simulator: bench/RESULTS.md 10e and 19.

Each policy is one entry of POLICIES and each protocol one entry of MODELS, so a new method is one function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynabatch.common.planning.optimum import PER_WORKER_BATCHES, NoiseScale, Optimum, calibrated_optimum
from dynabatch.common.planning.predicted_cluster import Cluster as Cluster  # where the predictor's callers look
from dynabatch.common.planning.predicted_cluster import Node as Node
from dynabatch.common.planning.predicted_cluster import cluster_of as cluster_of
from dynabatch.common.planning.predicted_cluster import node_of as node_of
from dynabatch.common.planning.predicted_cluster import pipelined as pipelined
from dynabatch.common.planning.protocol_models import MODELS, ProtocolModel
from dynabatch.common.protocols import SPECS

BISECTIONS = 60


@dataclass(frozen=True)
class Prediction:
    """One method on one cluster: each worker's batch and step (a local SGD worker's: its round), the samples per
    second applied, the samples one update is worth, the predicted time to target, and what it rests on: the mean
    staleness of an applied update, the fraction of computed samples discarded, the first round's extra seconds."""

    protocol: str
    policy: str
    batches: tuple[float, ...]
    step_s: tuple[float, ...]
    samples_per_s: float
    effective_batch: float
    time_s: float
    staleness: float = 0.0
    discarded: float = 0.0
    startup_s: float = 0.0


def _cap(node: Node) -> float:
    return float(node.device.max_batch) if node.device.max_batch else float("inf")


def _water_fill(cluster: Cluster, level_of: Callable[[float], list[float]]) -> list[float]:
    """The batches `level_of(level)` (each non-decreasing in the level, capped) whose sum is B: the level found by
    bisection. Where the caps cannot hold B, every worker at its cap."""
    caps = [_cap(n) for n in cluster.nodes]
    if sum(caps) <= cluster.global_batch:
        return caps
    low, high = 0.0, 1.0
    while sum(level_of(high)) < cluster.global_batch:
        high *= 2
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(level_of(mid)) < cluster.global_batch else (low, mid)
    return level_of(high)


def fixed_batches(cluster: Cluster, model: ProtocolModel | None = None) -> list[float]:
    """B/n each; a worker whose cap is below the share keeps its cap and the others share the rest."""
    return _water_fill(cluster, lambda level: [min(level, _cap(n)) for n in cluster.nodes])


def dynamic_batches(cluster: Cluster, model: ProtocolModel) -> list[float]:
    """Equal steps under the caps where a slower step costs the others (LB-BSP; local SGD's rounds), else batches in
    proportion to each worker's compute speed (DBS-SGD), capped; a worker holding a batch holds at least the job's
    --min-batch, as the scheduler's split gives it (a round that may leave a worker out gives it none instead).
    Where the least batch is what a slow worker gets, it is what sets a round's length: a CPU at 11 ms a sample
    computes eight local steps of 8 samples in 0.7 s, of 1 sample in 0.09 s (bench/RESULTS.md 60)."""
    nodes, least = cluster.nodes, float(cluster.min_batch)

    def held(node: Node, batch: float) -> float:
        if model.leaves_out and batch <= 0:
            return 0.0
        return min(_cap(node), max(least, batch))

    if model.equal_steps:
        return _water_fill(cluster, lambda t: [held(n, model.batch_within(cluster, n, t)) for n in nodes])
    share = cluster.global_batch / len(nodes)
    speeds = [n.device.speed(max(1, round(share))) for n in nodes]
    return _water_fill(cluster, lambda level: [held(n, level * s) for n, s in zip(nodes, speeds, strict=True)])


POLICIES: dict[str, Callable[[Cluster, ProtocolModel], list[float]]] = {
    "fixed": fixed_batches,
    "dynamic": dynamic_batches,
}

PROTOCOLS: tuple[str, ...] = tuple(name for name in SPECS if name in MODELS)
"""The protocols the predictor models (common/planning/protocol_models.py), in common/protocols.py's order."""


def predict(cluster: Cluster, noise: NoiseScale, protocol: str, policy: str) -> Prediction:
    """The time to target of `protocol` with batch `policy` on `cluster`: the first round's extra seconds, then the
    samples K(b) b = K_min (b + B_noise) at the effective batch b of an update over the samples per second.
    KeyError for a method not modelled."""
    model = MODELS[protocol]
    batches = _without_idle(cluster, model, POLICIES[policy])
    rate = model.throughput(cluster, batches, noise)
    startup = model.startup_s(cluster, fixed_batches(cluster), rate)
    steps = tuple(model.step_s(cluster, n, b) if b > 0 else 0.0 for n, b in zip(cluster.nodes, batches, strict=True))
    return Prediction(
        protocol,
        policy,
        tuple(batches),
        steps,
        rate.samples_per_s,
        rate.effective_batch,
        startup + noise.samples(rate.effective_batch) / rate.samples_per_s,
        rate.staleness,
        rate.discarded,
        startup,
    )


def _without_idle(
    cluster: Cluster, model: ProtocolModel, policy: Callable[[Cluster, ProtocolModel], list[float]]
) -> list[float]:
    """The `policy`'s batches, but none for the workers the protocol would idle (Ringmaster's, protocol_models.py
    `idle`), as the scheduler gives them: the others keep theirs."""
    batches = policy(cluster, model)
    idle = model.idle(cluster, batches)
    return [0.0 if i in idle else b for i, b in enumerate(batches)]


def predict_all(cluster: Cluster, noise: NoiseScale, protocols: Sequence[str] = PROTOCOLS) -> list[Prediction]:
    """Each of `protocols` that is modelled, with every policy, fastest first."""
    modelled = [p for p in protocols if p in PROTOCOLS]
    return sorted((predict(cluster, noise, p, q) for p in modelled for q in POLICIES), key=lambda p: p.time_s)


def optimum(cluster: Cluster, noise: NoiseScale) -> Optimum:
    """T* of the cluster's workers (compute only): the reference every prediction is judged against."""
    return calibrated_optimum(noise, [n.device for n in cluster.nodes], PER_WORKER_BATCHES)
