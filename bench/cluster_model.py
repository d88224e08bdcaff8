"""The cost model of a cluster the simulator runs: a worker's step curve, memory cap and link; the shards' queue.

A worker's step of b samples takes ``fixed_s + per_sample_s * b`` seconds on its own device, at most `max_batch`
samples (its memory): common/optimum.py's `Device`, which T* reads too. A transfer of n bytes over its link takes
``latency_s + 8 n / (mbit * 1e6)``. A shard is one server with a service rate: ZeroMQ delivers a message whole and
the shard handles one message at a time, so a request waits for those before it (first come, first served) and then
takes its bytes over the shard's rate. The model is cut evenly over the shards; a pull or push is done when the
last shard has served its part.

A gradient step overlaps its transfers with compute as the worker's pipeline does (worker/pipeline.py): the
pull's chunks stream while the forward pass runs and the push's chunks leave while backward runs, so with k
chunks two stages of a and c seconds take ``max(a, c) + min(a, c) / k`` instead of ``a + c``.

A push is booked at the shards when it arrives there (the simulator's worker waits for its link first), so
pushes are served in arrival order. A pull is booked when it is issued, for its arrival a link latency later, so
that the step's overlap can be known when the step starts; each request is served in the earliest free stretch
of the shard's time at or after its arrival long enough for it, so a pull booked a latency early does not hold
the shard idle for those that arrive before it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from dynabatch.common.prediction import pipelined

FORWARD_SHARE = 1.0 / 3.0
"""The forward pass's share of a step's compute (backward costs about twice the forward)."""


@dataclass(frozen=True)
class Link:
    """A worker's network link: its bandwidth in Mbit/s and its one-way latency."""

    mbit: float
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds for `nbytes` to cross the link, latency included."""
        return self.latency_s + 8.0 * nbytes / (self.mbit * 1e6)


@dataclass
class ShardQueue:
    """One shard as a server of `mbit` Mbit/s (0: instant): the stretches of time it is booked to serve."""

    mbit: float
    booked: list[tuple[float, float]] = field(default_factory=list)  # (start, end), in time order, disjoint
    busy_s: float = 0.0  # seconds spent serving, to judge its load

    def serve(self, arrival_s: float, nbytes: float, now: float | None = None) -> float:
        """Book a request of `nbytes` arriving at `arrival_s` into the first free stretch after it; returns when it
        has been served. `now` (default: the arrival) is the earliest any later request can arrive: stretches
        over by then are forgotten."""
        if self.mbit <= 0:
            return arrival_s
        service = 8.0 * nbytes / (self.mbit * 1e6)
        horizon = arrival_s if now is None else now
        while self.booked and self.booked[0][1] <= horizon:
            self.booked.pop(0)
        start = arrival_s
        for s, e in self.booked:
            if s >= start + service:
                break
            start = max(start, e)
        bisect.insort(self.booked, (start, start + service))
        self.busy_s += service
        return start + service


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

    def serve(self, arrival_s: float, now: float) -> float:
        """A whole model's worth of requests (a pull or a push to every shard) arriving at `arrival_s`, booked at
        `now`; returns when the last shard has served its part."""
        part = self.model_bytes / self.count
        return max(q.serve(arrival_s, part, now) for q in self.queues)


@dataclass(frozen=True)
class Network:
    """A worker's link to the shards, and the chunks a step's transfers are cut into (1: no overlap)."""

    link: Link
    shards: Shards
    chunks: int = 1

    def pull_s(self, now: float) -> float:
        """A pull issued at `now`: the request crosses the link, the shards serve the model, it crosses back."""
        served = self.shards.serve(now + self.link.latency_s, now)
        return served + self.link.transfer_s(self.shards.model_bytes) - now

    def exposed_pull_s(self, now: float, compute_s: float) -> float:
        """The part of a gradient step's pull, issued at `now`, that the forward pass of `compute_s` does not hide."""
        forward = FORWARD_SHARE * compute_s
        return pipelined(self.pull_s(now), forward, self.chunks) - forward

    def push_link_s(self, compute_s: float = 0.0) -> float:
        """How long a push crosses the link after the backward pass of a `compute_s` step has ended (0: a push that
        leaves after its compute, as a delta does)."""
        backward = (1.0 - FORWARD_SHARE) * compute_s
        return pipelined(backward, self.link.transfer_s(self.shards.model_bytes), self.chunks) - backward

    def served(self, arrival_s: float) -> float:
        """When the shards have served a push that arrives (whole) at `arrival_s`, booked on arrival."""
        return self.shards.serve(arrival_s, arrival_s)


def chunks_of(model_bytes: float, chunk_bytes: int) -> int:
    """How many chunks a model of `model_bytes` is cut into (common/chunking.py's cut, by bytes)."""
    return max(1, math.ceil(model_bytes / chunk_bytes))
