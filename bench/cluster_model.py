"""The cost model of a cluster the simulator runs: a worker's step curve, memory cap and link; the shards' queue.

A worker's step of b samples takes ``fixed_s + per_sample_s * b`` seconds on its own device (a GPU's fixed cost
is large and its per-sample cost small, a CPU's the other way round), at most `max_batch` samples (its memory).
A transfer of n bytes over its link takes ``latency_s + 8 n / (mbit * 1e6)``. A shard is one server with a
service rate: ZeroMQ delivers a message whole and the shard handles one message at a time, so a request waits
for those before it (first come, first served) and then takes its bytes over the shard's rate. The model is cut
evenly over the shards; a pull or push is done when the last shard has served its part.

A gradient step overlaps its transfers with compute as the worker's pipeline does (worker/pipeline.py): the
pull's chunks stream while the forward pass runs and the push's chunks leave while backward runs, so with k
chunks two stages of a and c seconds take ``max(a, c) + min(a, c) / k`` instead of ``a + c``.

A shard's request is queued when the worker issues it, at the time it will arrive (the step's plan is made when
the step starts): the queue is first come first served in the order requests were issued, each served no
earlier than its arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FORWARD_SHARE = 1.0 / 3.0
"""The forward pass's share of a step's compute (backward costs about twice the forward)."""


@dataclass(frozen=True)
class StepCurve:
    """A device's step time against its batch: a fixed cost per step plus a cost per sample."""

    fixed_s: float
    per_sample_s: float

    def seconds(self, batch: int) -> float:
        return self.fixed_s + self.per_sample_s * batch

    def samples_per_s(self, batch: int) -> float:
        return batch / self.seconds(batch)


@dataclass(frozen=True)
class Link:
    """A worker's network link: its bandwidth in Mbit/s and its one-way latency."""

    mbit: float
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds for `nbytes` to cross the link, latency included."""
        return self.latency_s + 8.0 * nbytes / (self.mbit * 1e6)


def pipelined(a_s: float, c_s: float, chunks: int) -> float:
    """Two stages of `a_s` and `c_s` seconds over `chunks` equal pieces: the second starts on a piece as soon as
    the first has done it."""
    return max(a_s, c_s) + min(a_s, c_s) / max(1, chunks)


@dataclass
class ShardQueue:
    """One shard as a server of `mbit` Mbit/s (0: instant), first come first served."""

    mbit: float
    free_at: float = 0.0
    busy_s: float = 0.0  # seconds spent serving, to judge its load

    def serve(self, arrival_s: float, nbytes: float) -> float:
        """Queue a request of `nbytes` arriving at `arrival_s`; returns when it has been served."""
        if self.mbit <= 0:
            return arrival_s
        service = 8.0 * nbytes / (self.mbit * 1e6)
        start = max(arrival_s, self.free_at)
        self.free_at = start + service
        self.busy_s += service
        return self.free_at


@dataclass
class Shards:
    """The job's shards, each holding an even part of the model's `model_bytes`."""

    count: int
    mbit: float
    model_bytes: float
    queues: list[ShardQueue] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"shards: {self.count} (at least 1)")
        self.queues = [ShardQueue(self.mbit) for _ in range(self.count)]

    def serve(self, arrival_s: float) -> float:
        """A whole model's worth of requests (a pull or a push to every shard) arriving at `arrival_s`; returns
        when the last shard has served its part."""
        part = self.model_bytes / self.count
        return max(q.serve(arrival_s, part) for q in self.queues)


@dataclass(frozen=True)
class StepPlan:
    """A gradient step's time: the pull's part not hidden by the forward pass, then compute, then the push's part
    after backward has ended (the shards' service included)."""

    exposed_pull_s: float
    push_tail_s: float


@dataclass(frozen=True)
class Network:
    """A worker's link to the shards, and the chunks a step's transfers are cut into (1: no overlap)."""

    link: Link
    shards: Shards
    chunks: int = 1

    def pull_s(self, now: float) -> float:
        """A pull issued at `now`: the request crosses the link, the shards serve the model, it crosses back."""
        served = self.shards.serve(now + self.link.latency_s)
        return served + self.link.transfer_s(self.shards.model_bytes) - now

    def push_s(self, now: float) -> float:
        """A push of the whole model's worth issued at `now`, until the last shard has served it."""
        return self.shards.serve(now + self.link.transfer_s(self.shards.model_bytes)) - now

    def gradient_step(self, now: float, compute_s: float) -> StepPlan:
        """Pull, forward, backward and push of one gradient step starting at `now`, overlapped chunk by chunk."""
        pull = self.pull_s(now)
        forward, backward = FORWARD_SHARE * compute_s, (1.0 - FORWARD_SHARE) * compute_s
        exposed_pull = pipelined(pull, forward, self.chunks) - forward
        gradient_at = now + exposed_pull + compute_s
        link_tail = pipelined(backward, self.link.transfer_s(self.shards.model_bytes), self.chunks) - backward
        return StepPlan(exposed_pull, self.shards.serve(gradient_at + link_tail) - gradient_at)


def chunks_of(model_bytes: float, chunk_bytes: int) -> int:
    """How many chunks a model of `model_bytes` is cut into (common/chunking.py's cut, by bytes)."""
    return max(1, math.ceil(model_bytes / chunk_bytes))
