"""The cost model of a cluster the simulator runs: a worker's step curve, memory cap and link; the shards' queue.

A worker's step of b samples takes ``fixed_s + per_sample_s * b`` seconds on its own device, at most `max_batch`
samples (its memory): common/planning/optimum.py's `Device`, which T* reads too. A transfer of n bytes over its link
takes ``latency_s + 8 n / (mbit * 1e6)``. A shard is one server with a service rate: ZeroMQ delivers a message whole
and the shard handles one message at a time, so requests wait at it, and it serves the waiting one first that the
scheduler ranks first (`Assignment.serve_ranks`, ps/serve_order.py's `rank_of`: none under `--chunk-schedule
fixed`), then the one that came first (a worker's requests are served in the order it made them, the front of the
model first within each), taking its bytes over the shard's rate, times a factor of mean 1 drawn log-normal where
the shard's service varies (`spread`: a shard that shares its cores with the workers is sometimes slow, and a queue
waits longer behind services that vary than behind as many of their mean). The model is cut evenly over the shards;
a pull or push is done when the last shard has served its part.

A gradient step overlaps its transfers with compute as the worker's pipeline does (worker/pipeline.py): the
pull's chunks stream while the forward pass runs and the push's chunks leave while backward runs, so with k
pieces two stages of a and c seconds take ``max(a, c) + min(a, c) / k`` instead of ``a + c``. A push goes as
``ceil(chunks / group)`` messages to each shard (the scheduler's `Assignment.chunk_group`, 1 under `fixed`), each
costing a fixed `MESSAGE_OVERHEAD_S` (scheduler/chunk_schedule.py's, the figure the scheduler plans with) beside
its bytes over the link, and at most `credit` bytes unacknowledged (`Assignment.credit_bytes`): past its first
credit's worth, a credit smaller than the link's bandwidth-delay product (a round trip, the shard's service of one
message included) slows the push to credit over round trip. Fewer, larger messages cost less overhead and
overlap less with backward.

A request reaches a shard a link latency after the worker sends it: a pull's at once, a push's once its bytes
have crossed the worker's link. Under `--chunk-schedule scheduled` a round's next pull leaves with the step's last
push and the shard sends each chunk as its round closes (worker/pipeline.py); the rounds close here all at once, so
the chunks are taken to have become due over the time the round's closing push took to cross its link, and the
pull's transfer overlaps that much of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dynabatch.common.planning.prediction import pipelined
from dynabatch.scheduler.chunk_schedule import MESSAGE_OVERHEAD_S

Wait = float | Callable[[], bool]  # what a process of the simulator's event loop yields: a time, or a condition

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
class Request:
    """One worker's request at one shard: its bytes and its place in the queue (rank, then order of arrival)."""

    nbytes: float
    rank: int
    order: int
    arrived: float = 0.0  # when it reached the shard
    done: bool = False


def mean_one(spread: float, z: float) -> float:
    """A log-normal factor of mean 1 and relative standard deviation `spread`, at the standard normal draw `z`."""
    sigma = math.sqrt(math.log1p(spread * spread))
    return math.exp(sigma * z - sigma * sigma / 2)


@dataclass
class ShardQueue:
    """One shard as a server of `mbit` Mbit/s (0: instant): the requests waiting for it, best first. Each service
    takes its bytes over that rate times a log-normal factor of mean 1 and relative spread `spread` (0: none), drawn
    from the shard's own generator, so a spread draws nothing from the workers' and none leaves every run as it was."""

    mbit: float
    spread: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    waiting: list[tuple[int, int, Request]] = field(default_factory=list)  # a heap by (rank, order)
    busy_s: float = 0.0  # seconds spent serving, to judge its load
    queued_s: float = 0.0  # seconds the requests it served waited first (as ps/serving_load.py counts them)
    busy_sq_s: float = 0.0  # the sum of each service's seconds squared (ps/serving_load.py's)
    transfers: int = 0  # requests served: each moves the shard's part of the model once (ps/serving_load.py's count)
    pushers: set[str] = field(default_factory=set)  # the workers whose push has reached it (ps/serving_load.py's)

    def service_s(self, nbytes: float) -> float:
        """Seconds the shard takes to serve `nbytes`."""
        return 8.0 * nbytes / (self.mbit * 1e6) if self.mbit > 0 else 0.0

    def drawn_service_s(self, nbytes: float) -> float:
        """Seconds one service of `nbytes` takes: `service_s` times a draw of the shard's spread."""
        service = self.service_s(nbytes)
        return service * mean_one(self.spread, self.rng.gauss(0.0, 1.0)) if self.spread > 0 else service

    def serving(self, clock: Callable[[], float], served: Callable[[], None]) -> Iterator[Wait]:
        """The shard at work, as a process of the simulator's event loop: whenever requests wait, it serves the
        best-ranked, then the earliest, and tells `served` (the workers waiting on it look again). Requests that
        arrive at the same instant are all in the queue before it chooses."""
        while True:
            yield lambda: bool(self.waiting)
            yield clock()
            request = heapq.heappop(self.waiting)[2]
            service = self.drawn_service_s(request.nbytes)
            self.busy_s += service
            self.queued_s += clock() - request.arrived
            self.busy_sq_s += service * service
            self.transfers += 1
            yield clock() + service
            request.done = True
            served()


@dataclass
class Shards:
    """The job's shards, each holding an even part of the model's `model_bytes`, each serving with a relative
    spread `spread` drawn from a generator of its own seeded from `seed`."""

    count: int
    mbit: float
    model_bytes: float
    spread: float = 0.0
    seed: int = 0
    queues: list[ShardQueue] = field(default_factory=list)
    arrivals: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"shards: {self.count} (at least 1)")
        self.queues = [
            ShardQueue(self.mbit, self.spread, random.Random(f"shard{i}:{self.seed}")) for i in range(self.count)
        ]

    def request(self, rank: int, now: float, pusher: str = "") -> list[Request]:
        """A whole model's worth of requests (a pull, or a push of worker `pusher`, to every shard) arriving `now`
        from a worker of serving rank `rank`; each is `done` once its shard has served it."""
        order = next(self.arrivals)
        requests = [Request(self.model_bytes / self.count, rank, order, now) for _ in self.queues]
        for q, r in zip(self.queues, requests, strict=True):
            heapq.heappush(q.waiting, (rank, order, r))
            if pusher:
                q.pushers.add(pusher)
        return requests


@dataclass(frozen=True)
class Network:
    """A worker's link to the shards, the chunks a step's transfers are cut into (1: no overlap), and what each
    message costs beside its bytes."""

    link: Link
    shards: Shards
    chunks: int = 1
    message_s: float = MESSAGE_OVERHEAD_S

    def pull_s(self, served_s: float, ahead_s: float = 0.0) -> float:
        """A pull whose request took `served_s` to reach the shards and be served: that, and the model back. A pull
        sent ahead (the scheduled wire's, in a round) was already bringing each chunk down as its round closed,
        over the `ahead_s` the round's closing push took to cross its link: what is left is the rest, at least
        its last chunk."""
        transfer = self.link.transfer_s(self.shards.model_bytes)
        return served_s + max(transfer / self.chunks, transfer - ahead_s)

    def exposed_pull_s(self, pull_s: float, compute_s: float) -> float:
        """The part of a gradient step's pull of `pull_s` that the forward pass of `compute_s` does not hide."""
        forward = FORWARD_SHARE * compute_s
        return pipelined(pull_s, forward, self.chunks) - forward

    def push_messages(self, group: int = 1) -> int:
        """The messages a push takes: `group` of a shard's chunks in each."""
        per_shard = math.ceil(self.chunks / self.shards.count)
        return self.shards.count * math.ceil(per_shard / max(1, group))

    def push_link_s(self, compute_s: float = 0.0, group: int = 1, credit: int = 0) -> float:
        """How long a push crosses the link after the backward pass of a `compute_s` step has ended (0: a push that
        leaves after its compute, as a delta does), in messages of `group` chunks with `credit` bytes in flight
        (0: no bound)."""
        messages, nbytes = self.push_messages(group), self.shards.model_bytes
        rate = self.link.mbit * 1e6 / 8.0
        first = nbytes if credit <= 0 else min(nbytes, credit)  # what may leave before the first acknowledgement
        after = rate
        if first < nbytes:
            one = nbytes / messages
            round_trip = 2 * self.link.latency_s + self.shards.queues[0].service_s(one) + one / rate
            after = min(rate, credit / round_trip)
        wire = self.link.latency_s + messages * self.message_s + first / rate + (nbytes - first) / after
        backward = (1.0 - FORWARD_SHARE) * compute_s
        return pipelined(backward, wire, messages) - backward


def chunks_of(model_bytes: float, chunk_bytes: int) -> int:
    """How many chunks a model of `model_bytes` is cut into (common/wire/chunking.py's cut, by bytes)."""
    return max(1, math.ceil(model_bytes / chunk_bytes))
