"""A method's time to target on a measured cluster, predicted without running it: what `dynabatch plan` prints and
what `--protocol auto` / `--batch-policy auto` would choose by (common/planning/auto_choice.py).

The model, each part a stated assumption:

- A worker's step computes b samples in `fixed_s + per_sample_s * b` (common/planning/optimum.py's Device), at most its
  cap, and moves the model twice (pull, push) over its link: 2 (latency + bytes / bandwidth), overlapped with the
  compute over the model's chunks as the pipeline does (`pipelined`).
- The batch policy gives each worker its batch (POLICIES): `fixed` B/n each, a capped worker held at its cap and
  the rest shared by the others (scheduler/batch_allocation.py's water-filling); `dynamic` equal step times under
  the caps where the protocol waits for the slowest (transfers included), else batches in proportion to compute speed.
- The protocol turns steps into updates (PROTOCOLS): a synchronous round (`ssgd`) waits for the slowest worker and
  makes one update of B samples, so it needs K(B) rounds (K(B) = K_min (1 + B_noise / B)). An asynchronous update
  (`asgd`) waits for no one but is stale: a gradient computed while the n - 1 others' were in flight is counted as
  worth no more than its share of a batch of all n (the effective batch of an update is n times the mean samples
  an update carries), so the samples to target are K_min (n b + B_noise). That is the staleness penalty this
  model states and cannot check: how much a stale gradient is worth depends on the step size and the task, and
  the regime study (bench/tuned_study.py) is what calibrates it (STALENESS_WEIGHT scales the n - 1).
- Shards with a service rate bound the workers' steps per second: each step moves the model in and out of them;
  a round's pushes queue at them as its workers finish (bench/RESULTS.md 17).

Not modelled: start-up (the steady state is predicted: a worker is measured by its first steps, and over a slow
link a first step can outlast the whole job), speed shifts, joins and leaves (the cluster as it starts), local
steps (local, msd), the protocols that discard or hold back slow work (ssp, ringmaster, rennala, softsync),
divergence at a too-large step size, and T*'s own limit (it counts compute only). No prediction falls below T*
on the shipped cluster files, the built-in profiles and random clusters (tests/test_prediction.py). Beside the
simulator: bench/RESULTS.md 10e.

Each policy is one entry of POLICIES and each protocol one entry of PROTOCOLS, so a new method is one function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynabatch.common.planning.cluster_file import ClusterFile, WorkerGroup
from dynabatch.common.planning.optimum import PER_WORKER_BATCHES, Device, NoiseScale, Optimum, calibrated_optimum
from dynabatch.common.protocols import SPECS, protocol_spec
from dynabatch.common.slowdown import Slowdown

STALENESS_WEIGHT = 1.0
"""How many of the other workers' gradients in flight an asynchronous update's staleness costs (1: all n - 1)."""
BISECTIONS = 60


def pipelined(a_s: float, c_s: float, chunks: int) -> float:
    """Two stages of `a_s` and `c_s` seconds over `chunks` equal pieces: the second starts on a piece as soon as
    the first has done it."""
    return max(a_s, c_s) + min(a_s, c_s) / max(1, chunks)


@dataclass(frozen=True)
class Node:
    """A worker as the predictor sees it: its step curve and cap, its link (0 Mbit/s: transfers not counted)."""

    device: Device
    link_mbit: float = 0.0
    latency_s: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """The workers, the global batch B, and what a step moves: the model's bytes over `chunks` pieces, shards
    serving `shard_mbit` each (0: at once)."""

    nodes: tuple[Node, ...]
    global_batch: int
    model_bytes: float = 0.0
    chunks: int = 1
    shards: int = 1
    shard_mbit: float = 0.0

    def __post_init__(self) -> None:
        if not self.nodes or self.global_batch < 1:
            raise ValueError("a cluster needs at least one worker and a global batch of at least 1")

    def transfer_s(self, node: Node) -> float:
        """A step's pull and push over the node's link."""
        if node.link_mbit <= 0:
            return 0.0
        return 2 * (node.latency_s + self.model_bytes * 8 / (node.link_mbit * 1e6))

    def step_s(self, node: Node, batch: float) -> float:
        return pipelined(node.device.seconds(batch), self.transfer_s(node), self.chunks)

    def compute_within(self, node: Node, step_s: float) -> float:
        """The most compute seconds a step of the node can hold and last at most `step_s` (`step_s` inverted)."""
        transfer, k = self.transfer_s(node), max(1, self.chunks)
        longer = step_s - transfer / k
        return longer if longer >= transfer else max(0.0, k * (step_s - transfer))

    def max_steps_per_s(self) -> float:
        """The shards' bound on the workers' steps: each moves the model in and out of them."""
        service = self.push_service_s()
        return float("inf") if service == 0 else 1 / (2 * service)

    def push_service_s(self) -> float:
        """How long the shards take to serve one push (or pull): each its part of the model at its rate, the shards
        in parallel; 0 where they serve at once."""
        if self.shard_mbit <= 0 or self.model_bytes <= 0:
            return 0.0
        return self.model_bytes / self.shards * 8 / (self.shard_mbit * 1e6)


def node_of(group: WorkerGroup) -> Node:
    """A file's worker as it starts: its curve times its slowdown at 0 (plus the slowdown's fixed part)."""
    slowdown = Slowdown.parse(group.slowdown)
    factor, own = slowdown.factor(0.0), group.device
    return Node(
        Device(own.fixed_s * factor + slowdown.fixed_s(0.0), own.per_sample_s * factor, own.max_batch),
        group.link_mbit,
        group.latency_s,
    )


def cluster_of(file: ClusterFile, global_batch: int, chunk_bytes: int) -> Cluster:
    """The workers a cluster file starts with (those that join later left out), at the file's global batch if it
    names one, else `global_batch`; the model cut into pieces of `chunk_bytes` for the pipeline."""
    nodes = tuple(node_of(g) for g in file.workers() if g.join_s == 0)
    chunks = max(1, round(file.model_bytes / chunk_bytes)) if chunk_bytes > 0 else 1
    return Cluster(nodes, file.global_batch or global_batch, file.model_bytes, chunks, file.shards, file.shard_mbit)


@dataclass(frozen=True)
class Prediction:
    """One method on one cluster: each worker's batch and step, the samples per second, the samples one update is
    worth, and the predicted time to target."""

    protocol: str
    policy: str
    batches: tuple[float, ...]
    step_s: tuple[float, ...]
    samples_per_s: float
    effective_batch: float
    time_s: float


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


def fixed_batches(cluster: Cluster, waits_for_slowest: bool) -> list[float]:
    """B/n each; a worker whose cap is below the share keeps its cap and the others share the rest."""
    return _water_fill(cluster, lambda level: [min(level, _cap(n)) for n in cluster.nodes])


def dynamic_batches(cluster: Cluster, waits_for_slowest: bool) -> list[float]:
    """Equal step times under the caps where a round waits for the slowest (LB-BSP), else batches in proportion to
    each worker's compute speed (DBS-SGD), capped."""
    nodes = cluster.nodes
    if waits_for_slowest:
        return _water_fill(
            cluster,
            lambda t: [
                min(_cap(n), max(0.0, (cluster.compute_within(n, t) - n.device.fixed_s) / n.device.per_sample_s))
                for n in nodes
            ],
        )
    share = cluster.global_batch / len(nodes)
    speeds = [n.device.speed(max(1, round(share))) for n in nodes]
    return _water_fill(cluster, lambda level: [min(_cap(n), level * s) for n, s in zip(nodes, speeds, strict=True)])


POLICIES: dict[str, Callable[[Cluster, bool], list[float]]] = {"fixed": fixed_batches, "dynamic": dynamic_batches}


def _synchronous(cluster: Cluster, noise: NoiseScale, batches: Sequence[float]) -> tuple[float, float]:
    """Rounds of B samples, each closing when the shards have taken the last push: (samples/s, samples per update).

    A round's pushes reach the shards as its workers finish, and the shards serve them one after another, so
    workers that finish together (equal steps: LB-BSP) wait for each other's pushes; the pulls that start the
    next round are hidden by the forward pass (the pipeline) and only bound the round through the shards' rate."""
    busy = [b for b in batches if b > 0]
    closed, service = 0.0, cluster.push_service_s()
    for end in sorted(cluster.step_s(n, b) for n, b in zip(cluster.nodes, batches, strict=True) if b > 0):
        closed = max(closed, end) + service
    round_s = max(closed, len(busy) / cluster.max_steps_per_s())
    total = sum(busy)
    return total / round_s, total


def _asynchronous(cluster: Cluster, noise: NoiseScale, batches: Sequence[float]) -> tuple[float, float]:
    """Every worker at its own pace, the updates bounded by the shards; an update worth n times the mean samples
    an update carries, n the workers in flight (STALENESS_WEIGHT scales the n - 1 others)."""
    pairs = [(n, b) for n, b in zip(cluster.nodes, batches, strict=True) if b > 0]
    rates = [1.0 / cluster.step_s(n, b) for n, b in pairs]
    updates = sum(rates)
    samples = sum(r * b for r, (_, b) in zip(rates, pairs, strict=True))
    slowed = min(1.0, cluster.max_steps_per_s() / updates)
    mean = samples / updates
    return samples * slowed, mean * (1 + STALENESS_WEIGHT * (len(pairs) - 1))


RULES: dict[str, tuple[bool, Callable[[Cluster, NoiseScale, Sequence[float]], tuple[float, float]]]] = {
    "round": (True, _synchronous),
    "async": (False, _asynchronous),
}
"""Each modelled shard rule (ProtocolSpec.shard_rule): whether a round waits for the slowest worker, and its
(samples/s, samples per update)."""

PROTOCOLS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.shard_rule in RULES)
"""The protocols whose shard rule is modelled (ssgd's round, asgd's take on arrival)."""


def predict(cluster: Cluster, noise: NoiseScale, protocol: str, policy: str) -> Prediction:
    """The time to target of `protocol` with batch `policy` on `cluster`: the samples K(b) b = K_min (b + B_noise)
    at the effective batch b of an update, over the samples per second. KeyError for a method not modelled."""
    waits, throughput = RULES[protocol_spec(protocol).shard_rule]
    batches = POLICIES[policy](cluster, waits)
    samples_per_s, effective = throughput(cluster, noise, batches)
    steps = tuple(cluster.step_s(n, b) if b > 0 else 0.0 for n, b in zip(cluster.nodes, batches, strict=True))
    return Prediction(
        protocol, policy, tuple(batches), steps, samples_per_s, effective, noise.samples(effective) / samples_per_s
    )


def predict_all(cluster: Cluster, noise: NoiseScale, protocols: Sequence[str] = PROTOCOLS) -> list[Prediction]:
    """Each of `protocols` that is modelled, with every policy, fastest first."""
    modelled = [p for p in protocols if p in PROTOCOLS]
    return sorted((predict(cluster, noise, p, q) for p in modelled for q in POLICIES), key=lambda p: p.time_s)


def optimum(cluster: Cluster, noise: NoiseScale) -> Optimum:
    """T* of the cluster's workers (compute only): the reference every prediction is judged against."""
    return calibrated_optimum(noise, [n.device for n in cluster.nodes], PER_WORKER_BATCHES)
