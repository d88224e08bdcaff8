"""A virtual-time cluster: N workers of given speeds, run in one process, ordered by virtual time.

Two cores cannot run 64 real workers, but how a protocol behaves with 64 workers
of unequal speed is a question about its rules, not about sockets. Here every
decision is made by the real code: the scheduler's `JobState` (speed model,
allocation, hysteresis, AdaComm's local-step rule) is fed the heartbeats a
worker would send, the shard's `ShardState` (its protocol rule and optimizer)
takes the pushes, and each gradient is a real gradient of the real model on the
worker's own data order. What is simulated is only time: a worker's step takes
``(a + c*b) * slowdown * noise`` virtual seconds, a transfer ``comm_s`` (or, for a node with its own link,
the model's bytes over it and through the shards' queue: bench/cluster_model.py). Events
are processed in virtual-time order (ties by a sequence number), so staleness
comes out exactly as a cluster of that shape would produce it, and a run is a
function of its seed.

The start is the real one's. Each worker first reports the speed it probed
(`Worker.probe`: worker/trainer.py's medians of compute-only steps at two batch
sizes, common/probe.py, slowed by a per-worker start-up contention factor measured
on real runs), and no batch is
handed out before every starting worker has reported (`dynabatch run` sets
min_workers to all of them), so the first split is the probes' guess, not yet the
equal-time one. A worker learns its batch as soon as the scheduler decides it (the
real one repeats its heartbeat until the answer holds one). Not simulated: CPU
contention between workers beyond the step noise, the pipelined push and transfer
time growing with load where a node has no link of its own, and the shard learning a new membership only at its own
heartbeat (every heartbeat_s; here at once).

Each worker is a generator that yields either a virtual time to sleep until or
a condition to wait for (a round to close, an ssp pull to be released). Its steps
are not written here: it runs its protocol's planner (worker/step_plans.py), the
one the real worker's loop runs, and executes each action the planner orders
(pull, compute, push, look after a delta in flight) in virtual time.

    python -m bench.simulate --protocol asgd --policy dynamic --profile tail16 --budget-s 20
    python -m bench.simulate --profile-file bench/profiles/mixed_gpus16.json --protocol asgd --policy fixed \
        --seed 0 --budget-s 20
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from bench.cluster_model import Link, Network, Shards, Wait, chunks_of, mean_one
from dynabatch.common import staleness
from dynabatch.common.config import AUTO_PROTOCOL, BATCH_POLICIES, JobConfig
from dynabatch.common.planning.auto_choice import choice_of
from dynabatch.common.planning.optimum import Device
from dynabatch.common.planning.protocol_switch import running, switch_plan, switch_to, switches
from dynabatch.common.probe import probe_batch, probe_steps, probed
from dynabatch.common.protocols import DELTA, GRADIENT, PROTOCOLS, protocol_settings, protocol_spec
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.tasks.data import NUM_CLASSES, Dataset, input_shape, load_dataset, make_batch
from dynabatch.common.tasks.models import build_model
from dynabatch.common.wire.chunking import FLOAT_BYTES, flat_grads, flat_params, load_flat, make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.ps.gradient_bounds import GradientBounds
from dynabatch.ps.push_bounds import AssignedBatches, max_push_samples, push_steps
from dynabatch.ps.serve_order import rank_of
from dynabatch.ps.shard_state import ProtocolSwitched, ShardState, StaleGradient
from dynabatch.ps.update_rules import optimizer_spec
from dynabatch.scheduler.auto_policy import AutoPolicy
from dynabatch.scheduler.job_state import JobState
from dynabatch.worker.batch_source import BatchSource, worker_order
from dynabatch.worker.heartbeats import heartbeat_after
from dynabatch.worker.local_steps import inner_optimizer
from dynabatch.worker.step_plans import (
    Ack,
    Action,
    Advance,
    Compute,
    Pull,
    Pulled,
    plan_for,
    pulls_ahead,
    round_after,
    send,
)
from dynabatch.worker.step_result import StepResult

MARKS = ("0.80", "0.85", "0.88")


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated node: its slowdown schedule (common/slowdown.py syntax), its link (how many times the
    cluster's `comm_s` its pull and its push each take: 10 is a link ten times slower), and when it is in the job.

    A node of a real cluster (bench/cluster_model.py, read from a profile file by bench/profile_file.py) has its
    own step curve (`fixed_s`, `per_sample_s`; None: the cluster's `SimConfig` ones), its memory cap
    (`max_batch`, the real worker's --max-batch; 0: none) and its own link (`link_mbit`, `latency_s`): with a
    link, its transfers cost the model's bytes over it and wait at the shards' queue instead of `comm_s`. Its steps
    vary by the cluster's `noise`, or by its own (`noise`: a worker measured on a loaded machine varies more, by
    a factor of mean 1 drawn log-normal, `mean_one`, which keeps the mean step whatever the spread). A node
    replaying a real worker reports the speed and fixed seconds that worker's start-up probe read (`probed`)
    instead of its simulated probe's: a probe under start-up load reads its fixed part to within tens of percent,
    and the efficient policy sizes the worker by that reading for the whole run."""

    slowdown: str = "1"
    join_s: float = 0.0
    leave_s: float = math.inf
    link: float = 1.0
    fixed_s: float | None = None
    per_sample_s: float | None = None
    max_batch: int = 0
    link_mbit: float = 0.0
    latency_s: float = 0.0
    noise: float | None = None  # the relative standard deviation of its steps, log-normal (None: the cluster's)
    probed: tuple[float, float] | None = None  # a real probe's samples/s and fixed seconds (None: simulated)

    def device(self, fixed_s: float, per_sample_s: float) -> Device:
        """This node's step curve and cap: its own curve, or the cluster's `fixed_s` and `per_sample_s`."""
        return Device(
            fixed_s if self.fixed_s is None else self.fixed_s,
            per_sample_s if self.per_sample_s is None else self.per_sample_s,
            self.max_batch,
        )


PROFILES: dict[str, Callable[[], tuple[WorkerSpec, ...]]] = {
    "bench4": lambda: tuple(WorkerSpec(s) for s in ("1", "1", "2", "4")),
    "tail16": lambda: tuple(WorkerSpec("1") for _ in range(12)) + tuple(WorkerSpec("8") for _ in range(4)),
    "lognormal64": lambda: lognormal(64, sigma=0.75, seed=64),
    "churn16": lambda: (
        tuple(WorkerSpec("1") for _ in range(10))
        + (WorkerSpec("1,6x@1s,1x@2s"), WorkerSpec("2"), WorkerSpec("4"))
        + (WorkerSpec("1", leave_s=1.5), WorkerSpec("1", join_s=1.0), WorkerSpec("2", join_s=2.0))
    ),
    "shifting32": lambda: shifting(
        lognormal(32, sigma=0.5, seed=32), factor=4.0, spell_s=(15.0, 45.0), horizon_s=150.0, seed=33
    ),
    "churn32": lambda: churn(lognormal(32, sigma=0.5, seed=34), leaving=6, joining=6, window_s=(20.0, 120.0), seed=35),
    "lognormal256": lambda: lognormal(256, sigma=0.75, seed=256),
    "links16": lambda: tuple(WorkerSpec("1") for _ in range(12)) + tuple(WorkerSpec("1", link=10.0) for _ in range(4)),
}
"""bench4: the real bench's 1,1,2,4. tail16: a long tail, 12 nodes at 1x and 4 at 8x. lognormal64, lognormal256:
64 or 256 nodes whose slowdowns are log-normal (sigma 0.75, relative to the fastest). churn16: a mid-run
slowdown, a departure and two joins, within 3 virtual s (the quick study). shifting32: 32 log-normal nodes (sigma
0.5), each 4x slower than itself for one spell of 15 to 45 virtual s at a random time within 150 s (another job
landing on it). churn32: 32 log-normal nodes, 6 of which leave and 6 more join at random times between 20 and 120
virtual s. links16: 16 equally fast nodes, 4 of them behind links 10 times slower (bench/links.py's 100 Mbit
among 1 Gbit). Every profile is fixed (the same nodes in every run); a run's seed varies the rest."""


def lognormal(n: int, sigma: float, seed: int) -> tuple[WorkerSpec, ...]:
    """`n` workers with log-normal speeds, fixed by `seed` (the profile is the same in every run)."""
    rng = random.Random(seed)
    draws = [math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]
    fastest = min(draws)
    return tuple(WorkerSpec(f"{d / fastest:.2f}") for d in draws)


def shifting(
    nodes: tuple[WorkerSpec, ...], factor: float, spell_s: tuple[float, float], horizon_s: float, seed: int
) -> tuple[WorkerSpec, ...]:
    """Each node `factor` times slower than itself for one spell of `spell_s` virtual seconds, at a random time
    before `horizon_s` (counted, like every slowdown schedule, from the node's first batch)."""
    rng = random.Random(seed)
    out = []
    for node in nodes:
        base = float(node.slowdown)
        length = rng.uniform(*spell_s)
        start = rng.uniform(1.0, horizon_s - length)
        out.append(WorkerSpec(f"{base:.2f},{base * factor:.2f}x@{start:.1f}s,{base:.2f}x@{start + length:.1f}s"))
    return tuple(out)


def churn(
    nodes: tuple[WorkerSpec, ...], leaving: int, joining: int, window_s: tuple[float, float], seed: int
) -> tuple[WorkerSpec, ...]:
    """`nodes`, of which `leaving` (chosen at random) leave at random times within `window_s`, and the same
    speeds again for `joining` more that join at random times within it."""
    rng = random.Random(seed)
    leavers = set(rng.sample(range(len(nodes)), leaving))
    out = [WorkerSpec(n.slowdown, leave_s=rng.uniform(*window_s)) if i in leavers else n for i, n in enumerate(nodes)]
    out += [WorkerSpec(rng.choice(nodes).slowdown, join_s=rng.uniform(*window_s)) for _ in range(joining)]
    return tuple(out)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are virtual seconds; `fixed_s + per_sample_s*b` is a 1x node's step."""

    protocol: str
    policy: str
    workers: tuple[WorkerSpec, ...]
    seed: int = 0
    budget_s: float = 20.0
    global_batch: int = 192
    model: str = "mlp"
    dataset: str = "fashion-mnist"
    fixed_s: float = 0.004
    per_sample_s: float = 0.0005
    noise: float = 0.05  # relative standard deviation of a step's time
    probe_steps: int = 9  # its timed steps, after one untimed (worker/options.py, --probe-steps)
    probe_noise: float = 0.14  # log-normal error of a worker's probe from start-up contention (see `probe`)
    comm_s: float = 0.002  # one pull or one push
    eval_every_s: float = 1.0
    eval_size: int = 2000
    job: dict[str, Any] = field(default_factory=dict)  # other JobConfig fields (lr, local_steps, ...)
    equal_steps: bool | None = None  # the dynamic split's objective, forced to compare (None: the protocol's own)
    # the transfers of workers with their own link (WorkerSpec.link_mbit): the model's bytes on the wire (0: the
    # trained model's), the shards they are cut over and each shard's service rate (0: instant)
    wire_bytes: float = 0.0
    shards: int = 1
    shard_mbit: float = 0.0
    shard_noise: float = 0.0  # the relative standard deviation of a shard's service, log-normal (0: every one alike)
    stop_at: float = 0.0  # end the run once it has reached this test accuracy (`reached_at`; 0: at the budget)
    # a time to an accuracy is the first evaluation at which the mean of the last this many reaches it (`reached_at`)
    reached_over: int = 1


@dataclass
class SimResult:
    """A run's figures in the shape bench/verdicts.py reads, plus its curves."""

    protocol: str
    policy: str
    seed: int
    workers: int
    time_to: dict[str, float | None]
    final_test_acc: float
    final_train_loss: float | None
    samples_per_s: float
    bytes_per_sample: float
    staleness_counts: list[int]
    staleness_mean: float | None
    staleness_p99: int | None
    samples: int
    curve: list[tuple[float, int, float]]  # (virtual seconds, samples, test accuracy)
    batches: dict[str, int]
    discarded_fraction: float = 0.0  # of the samples computed and pushed, those discarded as too stale
    # --protocol auto: pushes refused as made under the protocol before a switch; each crossed its link and was
    # served by the shard for nothing (a shard-bound job's switch refuses the pushes queued at it)
    switched_pushes: int = 0
    # --protocol auto: workers that entered a delta protocol on a switch from the model they held, with no pull
    held_starts: int = 0
    clipped: int = 0  # pushes the gradient bound clipped
    quarantined: int = 0  # workers the gradient bound quarantined
    # each worker's samples and last batch, by its instance "sim<i>", i its index in SimConfig.workers
    worker_samples: dict[str, int] = field(default_factory=dict)
    worker_batches: dict[str, int] = field(default_factory=dict)
    worker_steps: dict[str, int] = field(default_factory=dict)  # each worker's steps, by instance
    worker_discarded: dict[str, int] = field(default_factory=dict)  # each worker's discarded steps, by instance
    # each worker's wire plan at the end (chunks per push, bytes in flight: scheduler/wire_schedule.py), by instance
    worker_wire: dict[str, tuple[int, int]] = field(default_factory=dict)
    switched_to: str = ""  # --protocol auto: the protocol the workers stepped under at the end ("": another)
    # auto: each time it chose a new policy (and protocol), the virtual second and what it chose, with its reason
    auto_choices: list[tuple[float, str]] = field(default_factory=list)


Waiter = tuple[int, Callable[[], bool], Iterator[Wait]]  # a worker parked on a condition: (order, condition, worker)


class Cluster:
    """The event loop, the real scheduler and shard, and the shared pieces the workers use."""

    def __init__(self, cfg: SimConfig, data: Dataset) -> None:
        self.cfg = cfg
        self.data = data
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        starters = sum(1 for w in cfg.workers if w.join_s == 0)  # as `dynabatch run` does: all start on the same model
        self.job = JobConfig(
            protocol=cfg.protocol,
            batch_policy=cfg.policy,
            global_batch=cfg.global_batch,
            model=cfg.model,
            dataset=cfg.dataset,
            seed=cfg.seed,
            **{"epochs": 10_000, "min_workers": starters, **cfg.job},
        )
        # `--protocol auto` starts on its measuring protocol and switches as the real job does (protocol_switch.py)
        self.run_job = running(self.job, switch_plan(self.job).start) if switches(self.job) else self.job
        self.spec = protocol_spec(self.run_job.protocol)
        self.model = build_model(cfg.model, input_shape(cfg.dataset), NUM_CLASSES, cfg.seed)
        flat = flat_params(self.model)
        layout = make_layout(flat.numel(), self.job.chunk_bytes, 1)
        params = [(name, p.numel()) for name, p in self.model.named_parameters()]
        self.shard = ShardState.initial(
            layout.for_shard(0),
            flat,
            optimizer_spec(self.job, {}),
            self.run_job.protocol,
            cfg.global_batch,
            protocol_settings(self.run_job),
            params,
            self.job.dbs_weight,
        )
        self.model_bytes = FLOAT_BYTES * flat.numel()
        self.shard_queues = Shards(
            cfg.shards, cfg.shard_mbit, cfg.wire_bytes or self.model_bytes, cfg.shard_noise, cfg.seed
        )
        pipelines = self.run_job.pipelines(chunks_of(self.shard_queues.model_bytes, self.job.chunk_bytes))
        self.chunks = chunks_of(self.shard_queues.model_bytes, self.job.chunk_bytes) if pipelines else 1
        # The scheduled wire's pull sent ahead (worker/gradient_steps.py): a pipelined step of a protocol with one
        # push per round; `closing_push_s` is the link time of the push the shard served last.
        self.sends_pulls_ahead = pipelines and self.job.chunk_schedule == "scheduled" and pulls_ahead(self.spec)
        self.closing_push_s = 0.0
        self.bounds = GradientBounds(self.job.gradient_bound)  # the shard's bound on each push (server.py's)
        self.clipped = 0
        spec = self.spec if cfg.equal_steps is None else replace(self.spec, equal_steps=cfg.equal_steps)
        self.scheduler = JobState(self.job, num_shards=1, train_size=len(data.train_y), now=0.0, spec=spec)
        self.scheduler.hello(Hello(role=Role.SHARD, instance="ps"), 0.0)
        self.membership_seen: tuple[int, int, tuple[str, ...]] = (-1, -1, ())
        self.serve_ranks: dict[str, int] = {}  # the shard's serving ranks of workers, from its last assignment
        self.assigned = AssignedBatches(push_steps(self.run_job), max_push_samples(self.run_job))  # server.py's
        self.now = 0.0
        self.seq = 0
        self.timed: list[tuple[float, int, Iterator[Wait]]] = []
        self.waiting: list[Waiter] = []
        self.transfers = 0
        self.discarded_samples = 0  # computed, pushed, and discarded as too stale
        self.switched_pushes = 0  # of those, pushes made under the protocol before a switch (refused `switched`)
        self.held_starts = 0  # workers that entered a delta protocol on a switch from the model they held
        self.quarantined = 0  # workers the gradient bound quarantined (a run whose gradients blew up)
        self.counts: list[int] = []
        gen = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randperm(len(data.test_y), generator=gen)[: cfg.eval_size]
        self.test_x, self.test_y = make_batch(data, pick, train=False)
        self.curve: list[tuple[float, int, float]] = []
        self.auto_method = ""  # auto's protocol + policy when last seen (`_note_auto`)
        self.auto_changes: list[tuple[float, str]] = []  # when auto chose a new one, and what and why

    # -- the event loop -------------------------------------------------------------

    def spawn(self, gen: Iterator[Wait], at: float) -> None:
        self.seq += 1
        heapq.heappush(self.timed, (at, self.seq, gen))

    def _resume(self, gen: Iterator[Wait]) -> None:
        """Run `gen` until it sleeps or waits on a condition that does not hold yet."""
        while True:
            try:
                what = next(gen)
            except StopIteration:
                return
            self.seq += 1
            if not callable(what):
                heapq.heappush(self.timed, (max(what, self.now), self.seq, gen))
                return
            if not what():
                self.waiting.append((self.seq, what, gen))
                return

    def changed(self) -> None:
        """The shard or membership changed: resume every waiter whose condition now holds, in wait order."""
        self._note_auto()
        while True:
            ready: list[Waiter] = []
            still: list[Waiter] = []
            for w in self.waiting:
                (ready if w[1]() else still).append(w)
            if not ready:
                return
            self.waiting = still
            for _, _, gen in ready:
                self._resume(gen)

    def _note_auto(self) -> None:
        """Record when auto chose a new method, in virtual seconds: the allocator keeps only its last
        DECISIONS_KEPT decisions, which a cluster of 64 workers passes before the end."""
        auto = self.scheduler.allocator.auto
        if auto is None:
            return
        method = f"{auto.protocol} + {auto.policy}"
        if method != self.auto_method:
            if self.auto_method:
                self.auto_changes.append((self.now, auto_said(auto)))
            self.auto_method = method

    def run(self, until: float) -> None:
        while self.timed and self.timed[0][0] < until and not self.reached():
            self.now, _, gen = heapq.heappop(self.timed)
            self._resume(gen)

    # -- the scheduler and the shard --------------------------------------------------

    def report(self, wid: str, hb: WorkerHeartbeat) -> Told:
        """A worker's heartbeat; the shard then reports the membership it applies (as its heartbeat would).
        Returns the scheduler's answer."""
        self.scheduler.heartbeat(wid, hb, self.now)
        self.sync_shard()
        self.changed()
        return self.told(wid)

    def told(self, wid: str) -> Told:
        """What the scheduler holds for worker `wid` now: what the real worker's link hands it."""
        a = self.scheduler.assignment_for(self.scheduler.roster.members[wid])
        return Told(a.batch, a.local_steps, a.lr_scale, a.chunk_group, a.credit_bytes, a.protocol)

    def shard_beats(self) -> Iterator[Wait]:
        """The shard's own heartbeat every heartbeat_s (server.py's), beside those it sends at once when a worker
        reports: what it served reaches the scheduler while every worker is still in its first transfers."""
        while True:
            yield self.now + self.job.heartbeat_s
            self.sync_shard()
            self.changed()

    def sync_shard(self) -> None:
        """The shard's heartbeat: the push bounds it applied from its last answer, and again at once when this
        answer grows one (as server.py's: the scheduler hands a larger batch only once the shard reports it)."""
        busiest = max(self.shard_queues.queues, key=lambda q: q.busy_s)
        ps = self.scheduler.shard_heartbeat(
            "ps0",
            ShardHeartbeat(
                membership=self.scheduler.roster.membership,
                train_size=len(self.data.train_y),
                batches=self.assigned.told,
                protocol=self.shard.protocol,
                busy_s=busiest.busy_s,
                queued_s=busiest.queued_s,
                busy_sq_s=busiest.busy_sq_s,
                served=busiest.transfers,  # each request one message, moving the shard's part once
                transfers=float(busiest.transfers),
                pushed=sorted(busiest.pushers & set(self.scheduler.roster.live_workers)),
            ),
            self.now,
        )
        ordered = switch_to(ps.protocol, self.shard.protocol)
        if ordered is not None:  # as server.py's: the shard switches its rule, then reports it at once
            self.run_job = running(self.job, ordered)
            self.changed_after(self.shard.switch(ordered, protocol_settings(self.run_job)))
            self.assigned.steps, self.assigned.job_max = push_steps(self.run_job), max_push_samples(self.run_job)
            return self.sync_shard()
        if self.assigned.update(ps.batches):
            return self.sync_shard()
        self.serve_ranks = ps.serve_ranks
        seen = (ps.membership, ps.allocated, tuple(ps.idle_workers))
        if seen != self.membership_seen:
            self.membership_seen = seen
            self.shard.set_membership(set(ps.live_workers), ps.allocated, set(ps.idle_workers))
            self.changed()

    def changed_after(self, updated: list[int]) -> None:
        """The shard updated chunks `updated` outside a push (a switch closed its open round)."""
        if updated:
            self.changed()

    def pull(self) -> tuple[torch.Tensor, dict[int, int], int]:
        """The shard's parameters now (its tensors are never written in place, so this is a snapshot)."""
        got = self.shard.pull([])
        self.transfers += 1
        return torch.cat([t for _, t, _ in got]), {cid: v for cid, _, v in got}, self.shard.version

    def push(
        self, flat: torch.Tensor, versions: dict[int, int], samples: int, kind: str, wid: str, protocol: str = ""
    ) -> tuple[bool, int]:
        """One push of a gradient or delta, made under `protocol`; returns (applied now, the shard's version after
        it). ProtocolSwitched where the shard switched since (push_admission.py's first check after the form)."""
        self.shard.check_protocol(protocol)
        found = self.bounds.assess(
            wid,
            {c.id: flat[c.start : c.stop] for c in self.shard.chunks},
            samples,
            self.shard.params,
            self.shard.live,
            self.shard.share(samples),
        )
        outcome = self.shard.push(wid, found.tensors, versions, samples, kind, self.now)
        self.bounds.record(found, self.shard.live)
        self.clipped += bool(found.clipped)
        self.transfers += 1
        staleness.record(self.counts, outcome.staleness)
        self.changed()
        return bool(outcome.applied), outcome.version

    def reached(self) -> bool:
        """Whether the run has reached its `stop_at` accuracy (a tuning run needs no more than its time to it)."""
        cfg = self.cfg
        # the run stops at the first evaluation that reaches it: only the last ones can be new
        return (
            bool(cfg.stop_at) and reached_at(self.curve[-cfg.reached_over :], cfg.stop_at, cfg.reached_over) is not None
        )

    def evaluate(self) -> None:
        """Test accuracy of the shard's model now, on the run's fixed test subset."""
        load_flat(self.model, torch.cat([self.shard.params[c.id] for c in self.shard.chunks]))
        with torch.no_grad():
            acc = (self.model(self.test_x).argmax(1) == self.test_y).float().mean().item()
        self.curve.append((self.now, self.scheduler.progress.samples, acc))

    def evaluator(self) -> Generator[Wait, None, None]:
        while True:
            self.evaluate()
            yield self.now + self.cfg.eval_every_s


class Worker:
    """One simulated node: its speed, data order, heartbeat counters and (delta protocols) its own model."""

    def __init__(self, cluster: Cluster, index: int, spec: WorkerSpec) -> None:
        self.c = cluster
        self.index = index
        self.spec = spec
        self.slowdown = Slowdown.parse(spec.slowdown)
        self.rng = random.Random(cluster.cfg.seed * 1000 + index)
        self.source: BatchSource | None = None  # the worker's own data order, once it has an id
        self.hb = WorkerHeartbeat()
        self.wid = ""
        self.number = 0  # among the workers, as the scheduler numbered it (Welcome.number)
        self.told = Told()
        self.started = spec.join_s
        self.model: torch.nn.Module | None = None  # its own model (delta protocols)
        self.optimizer: torch.optim.Optimizer | None = None
        # The model its step started from (a gradient step's, or a delta's base), its chunks' versions and the
        # model's; msd's anchor (its model when it pushed) and the averaged model back for it (parameters, versions).
        self.base = torch.empty(0)
        self.base_versions: dict[int, int] = {}
        self.version = 0
        self.anchor = torch.empty(0)
        self.grads = torch.empty(0)  # a gradient step's gradient, taken when computed, until it is pushed
        self.back: tuple[torch.Tensor, dict[int, int], int] | None = None
        self.sync_s = 0.0  # msd: the transfers of its last delta and its average (the real loop's `comm_s`)
        self.moved = 0.0  # bytes its transfers moved over its own link, as the real worker reports them (0: none)
        self.running = cluster.spec  # the protocol it steps under (--protocol auto switches it)
        cfg = cluster.cfg
        self.device = spec.device(cfg.fixed_s, cfg.per_sample_s)
        gradient_chunks = cluster.chunks if cluster.spec.push_kind == GRADIENT else 1
        self.net = (
            Network(Link(spec.link_mbit, spec.latency_s), cluster.shard_queues, gradient_chunks)
            if spec.link_mbit > 0
            else None
        )

    @property
    def comm_s(self) -> float:
        """One pull or one push over this node's link, with no queue at the shards."""
        if self.net is None:
            return self.c.cfg.comm_s * self.spec.link
        return self.net.link.transfer_s(self.net.shards.model_bytes)

    def pull(self, compute: float | None = None, ahead: bool = False) -> Generator[Wait, None, None]:
        """A pull issued now: `comm_s`, or the request over this node's link, its wait and service at the shards
        (by rank, bench/cluster_model.py) and the model back; of a gradient step's pull, only what the forward pass
        of its `compute` seconds does not hide, where the pipeline overlaps them; `ahead`: a pull sent ahead with
        the last push, whose transfer overlapped the round's closing push (bench/cluster_model.py)."""
        c = self.c
        if self.net is None:
            yield c.now + self.comm_s
            return
        start = c.now
        yield from self._served(start + self.net.link.latency_s)
        pull = self.net.pull_s(c.now - start, c.closing_push_s if ahead else 0.0)
        yield max(c.now, start + (pull if compute is None else self.net.exposed_pull_s(pull, compute)))
        self.moved += self.net.shards.model_bytes

    def push(self, compute: float = 0.0) -> Generator[Wait, None, float]:
        """A push leaving now: `comm_s`, or over this node's link (overlapped with the backward pass of a gradient
        step of `compute` seconds, in the messages and credit its assignment gives) and then through the shards'
        queue. Returns its seconds."""
        c = self.c
        if self.net is None:
            yield c.now + self.comm_s
            return self.comm_s
        start = c.now
        link_s = self.net.push_link_s(compute, self.told.chunk_group, self.told.credit_bytes)
        yield from self._served(c.now + link_s, self.wid)
        c.closing_push_s = link_s
        self.moved += self.net.shards.model_bytes
        return c.now - start

    def _served(self, arrival: float, pusher: str = "") -> Generator[Wait, None, None]:
        """Until the shards have served a request of this worker (a push: `pusher` its id) that reaches them at
        `arrival`."""
        assert self.net is not None
        c = self.c
        yield arrival
        requests = self.net.shards.request(rank_of(self.wid, c.serve_ranks), c.now, pusher)
        c.changed()
        yield lambda: all(r.done for r in requests)

    def step_seconds(self, batch: int) -> float:
        cfg = self.c.cfg
        elapsed = self.c.now - self.started
        z = self.rng.gauss(0.0, 1.0)
        noise = max(0.2, 1.0 + cfg.noise * z) if self.spec.noise is None else mean_one(self.spec.noise, z)
        return (self.device.fixed_s + self.device.per_sample_s * batch) * self.slowdown.factor(
            elapsed
        ) * noise + self.slowdown.fixed_s(elapsed)

    def next_batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `b` samples of the real worker's own order (worker/batch_source.py); a simulated step never
        fails, so every batch taken is trained on."""
        assert self.source is not None, "a worker draws samples only once registered"
        idx = self.source.take(b)
        self.source.step_succeeded()
        return make_batch(self.c.data, idx, train=True)

    def gradient(self, model: torch.nn.Module, b: int) -> float:
        x, y = self.next_batch(b)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        torch.autograd.backward(loss)  # Tensor.backward is untyped in torch; this is the function it calls
        return loss.item()

    def beat(self, result: StepResult, sync_s: float = 0.0) -> None:
        """Report a step as the real worker does (worker/heartbeats.py), and take the answer for the next step."""
        self.hb = heartbeat_after(
            self.hb, result, sync_s=sync_s, moved_bytes=int(self.moved), discarded=self.hb.discarded
        )
        self.told = self.c.report(self.wid, self.hb)

    # -- joining and leaving ----------------------------------------------------------

    def probe(self) -> tuple[float, float, float]:
        """The standalone speed and fixed seconds per step the real worker reports before it is given a batch, and
        the seconds the probe took.

        As worker/trainer.py's `measure_standalone`, with its batches and medians (common/probe.py): one untimed
        step, then `probe_steps` timed ones and as many of the small batch in turn, forward and backward only (no
        pull or push), slowdown included. The real probe runs while the other processes are starting (imports, data, the
        model upload), which slows one worker's probe by a factor of its own: log-normal with sd `probe_noise`,
        0.14 being the pooled spread of log(probed / compute-only speed) between the four workers of 16 real
        asgd+dynamic runs at slowdowns 1, 1, 2, 4 on the bench machine (bench/overlap.py's runs). The factor
        slows both batches alike, so it overstates the fixed cost as it understates the speed. The scheduler's
        first split comes from these numbers (job_state.py, `_worker_heartbeat`: the speed model's prior), so the
        first batches are not yet the equal-time ones.
        """
        cfg = self.c.cfg
        batch = probe_batch(self.c.job.max_batch, self.device.max_batch)
        steps = probe_steps(batch, cfg.probe_steps)
        assert self.source is not None
        for b in [batch, *steps]:  # the real probe trains on these samples; training starts after them
            self.source.take(b)
        self.source.step_succeeded()
        times = [self.step_seconds(b) for b in [batch, *steps]]
        if self.spec.probed is not None:
            return (*self.spec.probed, sum(times))
        contention = math.exp(self.rng.gauss(0.0, cfg.probe_noise))
        speed, fixed_s = probed(steps, [t * contention for t in times[1:]])
        return speed, fixed_s, sum(times)

    def live(self) -> Generator[Wait, None, None]:
        """Join at `join_s`, probe, wait for a batch, run the protocol's loop, leave at `leave_s`.

        The workers of the start probe before virtual time 0, as the real ones probe before the first
        batches the real runs' clocks count from (`dynabatch run` sets min_workers to all of them,
        cluster/main.py, so no batch is handed out before the last has reported); a worker that joins
        later spends its probe's time after `join_s`, before it is counted in n.
        """
        c = self.c
        welcome = c.scheduler.hello(
            Hello(role=Role.WORKER, instance=f"sim{self.index}", max_batch=self.device.max_batch), c.now
        )
        self.wid, self.number = welcome.id, welcome.number
        self.source = BatchSource(worker_order(len(c.data.train_y), c.job.seed, self.number))
        standalone, fixed_s, probe_s = self.probe()
        if self.spec.join_s > 0:
            yield c.now + probe_s
        self.hb = WorkerHeartbeat(standalone_sps=standalone, standalone_fixed_s=fixed_s)
        self.told = c.report(self.wid, self.hb)
        if self.told.batch == 0:
            # The real worker repeats its heartbeat until the answer holds a batch (worker/trainer.py,
            # _await_batch), so it learns the batch within a round trip of the scheduler deciding it.
            yield from self._await_batch()
        self.started = c.now  # slowdown schedules count from the first batch (worker/trainer.py, _train_steps)
        try:
            yield from self.steps()
        except ProtocolError as refused:
            if refused.code != ErrorCode.QUARANTINED:
                raise
            # The real worker retries its refused steps (worker/trainer.py); none changes anything, so it stops here.
            c.quarantined += 1

    def leaving(self) -> bool:
        if self.c.now < self.spec.leave_s:
            return False
        self.c.scheduler.bye(self.wid, self.c.now)
        self.c.sync_shard()
        return True

    # -- the protocol's steps, as the worker's own planner orders them ------------------------

    def _await_batch(self) -> Generator[Wait, None, None]:
        """Until the scheduler gives this worker a batch (worker/trainer.py, _await_batch)."""
        c = self.c
        yield lambda: c.scheduler.allocator.allocation.get(self.wid, 0) > 0
        self.told = c.told(self.wid)

    def steps(self) -> Generator[Wait, None, None]:
        """Step after step until the node leaves, each as the protocol's planner orders it (worker/step_plans.py,
        the plan the real worker's loop runs), its actions executed in virtual time (`_execute`)."""
        c = self.c
        plan = plan_for(self.running)
        while not self.leaving():
            if self.told.batch == 0:  # left out (batch 0): idle until the scheduler gives it a batch again
                yield from self._await_batch()
            ordered = switch_to(self.told.protocol, self.running.name)
            if ordered is not None:  # the real worker enters the new protocol's loop (worker/trainer.py, _switch)
                self.running, plan, self.optimizer = protocol_spec(ordered), plan_for(protocol_spec(ordered)), None
                if self.base.numel() and plan.start_held():
                    c.held_starts += 1
            record = _StepRecord()
            step = plan.step(self.told)
            try:
                action: Action | None = next(step)
                while action is not None:
                    action = send(step, (yield from self._execute(action, record)))
            except (StaleGradient, ProtocolSwitched) as refused:
                # discarded (ssgd, msync, ringmaster, rennala), or made under the protocol before a switch: the real
                # worker pulls again at once
                c.discarded_samples += record.batch
                c.switched_pushes += isinstance(refused, ProtocolSwitched)
                plan.after_failure(refused.code)
                # counted in its heartbeat (WorkerHeartbeat.discarded), which the scheduler judges idling by
                self.hb = replace(self.hb, discarded=self.hb.discarded + 1)
                self.told = c.report(self.wid, self.hb)
                continue
            loss = sum(record.losses) / len(record.losses)
            self.beat(StepResult(record.times, record.batch, loss, self.version, record.steps), sync_s=self.sync_s)

    def _execute(self, action: Action, record: _StepRecord) -> Generator[Wait, None, object]:
        """One planned action in virtual time; returns its outcome for the planner."""
        c = self.c
        if isinstance(action, Pull) and action.held:  # the model this worker's last step computed on: no transfer
            load_flat(self._own_model(), self.base)
            return Pulled([self.version], self.version)
        if isinstance(action, Pull):
            record.asked = c.now
            if action.min_versions is not None:
                target = action.min_versions[0]
                yield lambda: c.shard.version >= target
            yield lambda: c.shard.admit_pull(self.wid)  # answered now: a rule may count the worker as computing
            self.base, self.base_versions, self.version = c.pull()
            if self.running.push_kind == GRADIENT:  # the pull overlaps the forward pass of the step it feeds
                record.compute_s = self.step_seconds(self.told.batch)
                yield from self.pull(record.compute_s, c.sends_pulls_ahead and action.min_versions is not None)
            else:
                yield from self.pull()
            if action.waits:
                record.times.wait_s += c.now - record.asked
            else:
                record.times.pull_s += c.now - record.asked
            if self.running.push_kind == DELTA:
                load_flat(self._own_model(), self.base)
            return Pulled([self.version], self.version)
        if isinstance(action, Compute):
            record.batch, record.steps = action.batch, action.steps
            if self.running.push_kind == GRADIENT:
                compute = record.compute_s if action.batch == self.told.batch else self.step_seconds(action.batch)
                yield c.now + compute
                load_flat(c.model, self.base)
                record.losses = [self.gradient(c.model, action.batch)]
                self.grads = flat_grads(c.model)  # now: the model is every worker's, the next compute overwrites it
            else:
                scale = self.told.lr_scale
                compute = sum(self.step_seconds(action.batch) for _ in range(action.steps))
                yield c.now + compute
                record.losses = [self._local_step(action.batch, scale) for _ in range(action.steps)]
            record.times.compute_s += compute
            record.compute_s = compute
            return True
        if isinstance(action, Advance):
            return self._correct()
        if action.in_flight:
            record.times.push_s += self.comm_s
            self.anchor = flat_params(self._own_model())
            c.spawn(self._delta_in_flight(self.base - self.anchor, self.base_versions, action.samples), c.now)
            return None
        record.times.push_s += yield from self.push(record.compute_s if action.kind == GRADIENT else 0.0)
        pushed = self.grads if action.kind == GRADIENT else self.base - flat_params(self._own_model())
        applied, after = c.push(pushed, self.base_versions, action.samples, action.kind, self.wid, self.running.name)
        return [Ack(applied, after)]

    def _own_model(self) -> torch.nn.Module:
        if self.model is None:
            self.model = build_model(self.c.cfg.model, input_shape(self.c.cfg.dataset), NUM_CLASSES, self.c.cfg.seed)
        return self.model

    def _local_step(self, b: int, lr_scale: float) -> float:
        """One SGD step on this worker's own model, with the optimizer the real loop builds (_LocalSteps)."""
        model = self._own_model()
        self.optimizer = inner_optimizer(self.optimizer, model, self.c.job, lr_scale)
        loss = self.gradient(model, b)
        self.optimizer.step()
        return loss

    def _correct(self) -> bool:
        """msd: once the averaged model is back, move onto it with this worker's progress since it pushed."""
        if self.back is None:
            return False
        global_flat, self.base_versions, self.version = self.back
        model = self._own_model()
        load_flat(model, global_flat + (flat_params(model) - self.anchor))
        self.base, self.back = global_flat.clone(), None
        return True

    def _delta_in_flight(
        self, delta: torch.Tensor, versions: dict[int, int], samples: int
    ) -> Generator[Wait, None, None]:
        """The push travels, the round closes when everyone has pushed, the average travels back."""
        c = self.c
        sent = c.now
        yield from self.push()
        if self.wid not in c.shard.live:
            return
        applied, after = c.push(delta, versions, samples, DELTA, self.wid, self.running.name)
        target = round_after([Ack(applied, after)])[0]
        yield lambda: c.shard.version >= target
        pushed_s = c.now - sent
        back = c.pull()
        asked = c.now
        yield from self.pull()
        pulled_s = c.now - asked
        self.back = back
        self.sync_s = pushed_s + pulled_s  # transfers only: the wait for the round is not communication


@dataclass
class _StepRecord:
    """What one simulated step did, for its report: its times (virtual seconds) counted as the real worker's
    loops count them (a pull's time, transfer included, is waiting where the plan says it waits), its batch,
    local steps and losses."""

    times: StepTimes = field(default_factory=StepTimes)
    asked: float = 0.0  # when the pull was asked for
    compute_s: float = 0.0  # a gradient step's compute, drawn at its pull (the pull overlaps its forward pass)
    batch: int = 0
    steps: int = 1
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Told:
    """The scheduler's last answer to a simulated worker, as the real worker's assignment carries it: the batch and
    H its planner reads for a step (worker/step_plans.py `Orders`), the local steps' learning-rate scale, and how its
    push leaves (scheduler/wire_schedule.py)."""

    batch: int = 0
    local_steps: int = 1
    lr_scale: float = 1.0
    chunk_group: int = 1  # the wire's schedule: chunks per push, and bytes in flight (0: no bound)
    credit_bytes: int = 0
    protocol: str = ""  # --protocol auto: the one to step under ("": the job's)


def simulate(cfg: SimConfig, data: Dataset | None = None) -> SimResult:
    """Run `cfg` to its virtual budget; deterministic for a given config (seed included)."""
    torch.set_num_threads(1)
    data = data or load_dataset(cfg.dataset)
    cluster = Cluster(cfg, data)
    workers = [Worker(cluster, i, spec) for i, spec in enumerate(cfg.workers)]
    for w in workers:
        cluster.spawn(w.live(), w.spec.join_s)
    if any(w.net is not None for w in workers):
        for q in cluster.shard_queues.queues:
            cluster.spawn(q.serving(lambda: cluster.now, cluster.changed), 0.0)
        cluster.spawn(cluster.shard_beats(), 0.0)
    cluster.spawn(cluster.evaluator(), 0.0)
    cluster.run(cfg.budget_s)
    if not cluster.reached():
        cluster.now = cfg.budget_s
        cluster.evaluate()  # the model at the budget
    return result_of(cluster)


def reached_at(curve: list[tuple[float, int, float]], accuracy: float, over: int = 1) -> float | None:
    """The first evaluation of `curve` (virtual seconds, samples, test accuracy) at which the mean of the last `over`
    evaluations is at least `accuracy`; None if none is. With `over` 1 that is the first evaluation at or above it.
    Why more than one: where a method's accuracy levels off near the target, consecutive evaluations move by several
    points (the model's own noise at a large step), and the first one above it is a matter of luck
    (bench/RESULTS.md 56)."""
    for j in range(over - 1, len(curve)):
        if sum(acc for _, _, acc in curve[j - over + 1 : j + 1]) >= accuracy * over:
            return curve[j][0]
    return None


def result_of(cluster: Cluster) -> SimResult:
    cfg, sched = cluster.cfg, cluster.scheduler
    samples = sched.progress.samples
    stats = staleness.stats(cluster.counts)
    time_to = {m: reached_at(cluster.curve, float(m), cfg.reached_over) for m in MARKS}
    workers = [m for m in sched.roster.members.values() if m.role == Role.WORKER]
    loss = sched.progress.loss
    return SimResult(
        protocol=cfg.protocol,
        policy=cfg.policy,
        seed=cfg.seed,
        workers=len(cfg.workers),
        time_to=time_to,
        final_test_acc=cluster.curve[-1][2],
        final_train_loss=None if math.isnan(loss) else loss,
        samples_per_s=samples / (cluster.now or cfg.budget_s),  # a run stopped at its target: its own time
        bytes_per_sample=cluster.transfers * cluster.model_bytes / max(1, samples),
        staleness_counts=list(cluster.counts),
        staleness_mean=stats.mean,
        staleness_p99=stats.p99,
        samples=samples,
        curve=cluster.curve,
        batches=dict(sched.allocator.allocation),
        clipped=cluster.clipped,
        quarantined=cluster.quarantined,
        discarded_fraction=cluster.discarded_samples / max(1, samples + cluster.discarded_samples),
        switched_pushes=cluster.switched_pushes,
        held_starts=cluster.held_starts,
        worker_samples={m.instance: m.samples for m in workers},
        worker_batches={m.instance: sched.allocator.allocation.get(m.id, 0) for m in workers},
        worker_steps={m.instance: m.steps for m in workers},
        worker_discarded={m.instance: m.last.discarded for m in workers},
        worker_wire={m.instance: (sched.wire.plan_of(m.id).group, sched.wire.plan_of(m.id).credit) for m in workers},
        switched_to=sched.protocol.workers if sched.protocol is not None else "",
        auto_choices=auto_choices(cluster),
    )


def auto_choices(cluster: Cluster) -> list[tuple[float, str]]:
    """When auto chose a new policy or protocol (the virtual second, what and why), and its reason now (-1)."""
    auto = cluster.scheduler.allocator.auto
    if auto is None:
        return []
    return [*cluster.auto_changes, (-1.0, auto_said(auto))]


def auto_said(auto: AutoPolicy) -> str:
    """What auto runs and why, its method first."""
    method = f"{auto.protocol} + {auto.policy}"
    return auto.reason if choice_of(auto.reason) == method else f"{method}: {auto.reason}"


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: give a positive number of seconds")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.simulate",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    p.add_argument(
        "--protocol",
        default="asgd",
        choices=(*PROTOCOLS, AUTO_PROTOCOL),
        help="default asgd (a job's default is auto: give --protocol auto --policy auto to simulate it)",
    )
    p.add_argument("--policy", default="dynamic", choices=BATCH_POLICIES, help="default dynamic (a job's: auto)")
    p.add_argument("--profile", default="bench4", choices=sorted(PROFILES), help="a built-in cluster (default bench4)")
    p.add_argument(
        "--profile-file",
        help="a cluster described in a JSON file (its format: common/planning/cluster_file.py), instead of --profile",
    )
    p.add_argument("--shards", type=int, default=0, help="with --profile-file: this many shards (default: the file's)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--budget-s", type=_positive, default=10.0, help="virtual seconds (default 10)")
    p.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="default: --profile-file's, else the job's (as dynabatch plan); a built-in --profile's 16 per worker",
    )
    p.add_argument("--model", default="mlp", help="the job's --model (default mlp; a job's default is cnn)")
    p.add_argument("--lr", type=float, default=0.0, help="the job's --lr (default: JobConfig's)")
    p.add_argument("--sync-m", type=int, default=0, help="the job's --sync-m (msync: the gradients a round takes)")
    p.add_argument(
        "--gradient-bound", type=float, default=JobConfig.gradient_bound, help="the shards' --gradient-bound (0: off)"
    )
    p.add_argument(
        "--study",
        choices=(
            "quick",
            "paper",
            "validation",
            "full",
            "tuned",
            "tuned-scale",
            "tuned-256",
            "tuned-unseen",
            "tuned-changing",
            "tuned-quick",
            "tuned-policies",
            "tuned-recheck",
            "regimes",
            "regimes-cut",
            "regimes-reduced",
            "regimes-fine",
            "regimes-drawn",
        ),
        help="run a study instead: bench/simulate_study.py's, or tuned*: bench/tuned_study.py's (every "
        "method at its own tuned step size)",
    )
    p.add_argument("--jobs", type=int, default=1, help="processes for the study's runs (default 1)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="tuned*: keep the runs already in the study's results.json and run only the rest",
    )
    p.add_argument(
        "--methods",
        default="",
        help="tuned*, regimes: run only these methods' report runs (comma-separated names of bench/tuned_study.py "
        "METHODS, or default: what a job runs with every flag at its default) at the step sizes TUNED_LRS holds "
        "for each profile, into the study's folder beside its other runs",
    )
    p.add_argument(
        "--out", default="bench/results/simulate", help="folder of a study's results (default: bench/results/simulate)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.study and args.study.startswith(("tuned", "regimes")):
        from bench import tuned_study

        only = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        return tuned_study.run_study(args.study, args.out, args.jobs, args.resume, only)
    if args.study:
        from bench.simulate_study import run_study

        return run_study(args.study, args.out, args.jobs)
    from bench.profile_file import ClusterProfile, ProfileError, read_profile

    try:
        profile = (
            read_profile(args.profile_file)
            if args.profile_file
            else ClusterProfile(args.profile, PROFILES[args.profile]())
        )
    except ProfileError as exc:
        print(f"python -m bench.simulate: {exc}", file=sys.stderr)
        return 2
    workers = profile.workers
    cfg = SimConfig(
        args.protocol,
        args.policy,
        workers,
        seed=args.seed,
        budget_s=args.budget_s,
        global_batch=args.global_batch
        or profile.global_batch
        or (JobConfig.global_batch if profile.file else 16 * len(workers)),
        model=args.model,
        job={**({"lr": args.lr} if args.lr else {}), "gradient_bound": args.gradient_bound, "sync_m": args.sync_m},
        **{**profile.sim_settings(), **({"shards": args.shards} if args.shards else {})},
    )
    r = simulate(cfg)
    print(
        f"{r.protocol}+{r.policy} on {profile.name} ({r.workers} workers), seed {r.seed}: "
        f"{100 * r.final_test_acc:.2f}% after {r.samples} samples in {cfg.budget_s:g} virtual s; "
        f"staleness mean {r.staleness_mean if r.staleness_mean is None else round(r.staleness_mean, 2)}, "
        f"p99 {r.staleness_p99}; time to 80%: {r.time_to['0.80']}, to 85%: {r.time_to['0.85']}; "
        f"{r.samples_per_s:.0f} samples/s, {100 * r.discarded_fraction:.1f}% of pushed samples discarded "
        f"({r.switched_pushes} pushes as made before a protocol switch), "
        f"{r.clipped} pushes clipped"
    )
    if r.auto_choices:
        print(f"auto ran {r.auto_choices[-1][1]}")  # the method it ran last, and why
        print(f"{r.held_starts} workers entered the protocol switched to from the model they held, with no pull")
    print(
        "each worker's last batch (0: left out or idle) and samples: "
        + ", ".join(f"{w} b={r.worker_batches.get(w, 0)} {n}" for w, n in sorted(r.worker_samples.items()))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
