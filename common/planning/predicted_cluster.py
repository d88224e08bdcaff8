"""A measured cluster as the predictor (common/planning/prediction.py) sees it: each worker's step curve, cap and
link, the shards' service rate, the model's bytes and the job's global batch; what one step costs on it.

A worker's step computes b samples in `fixed_s + per_sample_s * b` (common/planning/optimum.py's Device), at most
its cap, and moves the model twice (pull, push) over its link: 2 (latency + bytes / bandwidth), overlapped with the
compute over the model's chunks as the pipeline does (`pipelined`). Shards with a service rate take each pull and
push in turn, the shards in parallel, each its part of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.planning.cluster_file import ClusterFile, WorkerGroup
from dynabatch.common.planning.optimum import Device
from dynabatch.common.protocols import DEFAULT_LOCAL_STEPS
from dynabatch.common.slowdown import Slowdown


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
    serving `shard_mbit` each (0: at once); `local_steps`, the H a local SGD round takes (--local-steps);
    `min_batch`, the least batch the scheduler gives a worker that holds one (--min-batch)."""

    nodes: tuple[Node, ...]
    global_batch: int
    model_bytes: float = 0.0
    chunks: int = 1
    shards: int = 1
    shard_mbit: float = 0.0
    local_steps: int = DEFAULT_LOCAL_STEPS
    min_batch: int = 1

    def __post_init__(self) -> None:
        if not self.nodes or self.global_batch < 1 or self.local_steps < 1 or self.min_batch < 1:
            raise ValueError(
                "a cluster needs at least one worker, a global batch, local steps and a least batch of at least 1"
            )

    def transfer_s(self, node: Node) -> float:
        """A step's pull and push over the node's link."""
        if node.link_mbit <= 0:
            return 0.0
        return 2 * (node.latency_s + self.model_bytes * 8 / (node.link_mbit * 1e6))

    def step_s(self, node: Node, batch: float) -> float:
        """A gradient step: the compute of `batch` samples pipelined with the pull and push over the node's link."""
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


def measured_node(device: Device, transfer_s: float, model_bytes: float) -> Node:
    """A worker as a running job measures it: its compute curve and cap (`device`), and the seconds one step's pull
    and push spent on its link (`transfer_s`), given as the link that moves the model's bytes twice in that time.
    So each protocol's model places the transfers itself (pipelined under a gradient step, once per H steps under
    local SGD); folded into the fixed cost they would count H times in a local round. No transfer measured: no link.

    `transfer_s` is the link's own time, not the time a request waited in a busy shard's queue: that belongs to the
    shards (the Cluster's `shards` and `shard_mbit`, from the rate they serve at). Counted in the link it is paid by
    every protocol alike, and the shard-bound regime, where local SGD wins, is no longer seen (bench/RESULTS.md 19)."""
    if transfer_s <= 0 or model_bytes <= 0:
        return Node(device)
    return Node(device, 2 * model_bytes * 8 / (transfer_s * 1e6))


def node_of(group: WorkerGroup) -> Node:
    """A file's worker as it starts: its curve times its slowdown at 0 (plus the slowdown's fixed part)."""
    slowdown = Slowdown.parse(group.slowdown)
    factor, own = slowdown.factor(0.0), group.device
    return Node(
        Device(own.fixed_s * factor + slowdown.fixed_s(0.0), own.per_sample_s * factor, own.max_batch),
        group.link_mbit,
        group.latency_s,
    )


def cluster_of(file: ClusterFile, global_batch: int, chunk_bytes: int, min_batch: int = 1) -> Cluster:
    """The workers a cluster file starts with (those that join later left out), at the file's global batch if it
    names one, else `global_batch`; the model cut into pieces of `chunk_bytes` for the pipeline; a worker holding a
    batch holds at least `min_batch` (the job's --min-batch)."""
    nodes = tuple(node_of(g) for g in file.workers() if g.join_s == 0)
    chunks = max(1, round(file.model_bytes / chunk_bytes)) if chunk_bytes > 0 else 1
    return Cluster(
        nodes,
        file.global_batch or global_batch,
        file.model_bytes,
        chunks,
        file.shards,
        file.shard_mbit,
        min_batch=min_batch,
    )
