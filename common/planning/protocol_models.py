"""How each modelled protocol turns the workers' steps into updates: samples per second, the samples one update is
worth, its mean staleness, and what its first round costs before the scheduler has measured anyone.

Each model states its assumptions (bench/RESULTS.md 19 sets them beside the simulator):

- `ssgd` (`Rounds`): a round waits for the slowest worker and makes one update of B samples; it closes when the
  shards have served its pushes, which queue as its workers finish.
- `asgd` (`Arrivals`): every worker at its own pace, each gradient applied on arrival. A gradient is stale by the
  updates the others applied while it was computed, (U - r_i) t_i for a worker of r_i = 1 / t_i steps per second
  among U in all: weighted by updates that is n - 1 whatever the speeds. An update is worth no more than its share
  of a batch of 1 + STALENESS_WEIGHT x staleness updates (the effective batch). Only the k fastest workers' updates
  count, k the one that reaches the target first: the delay step makes a far slower worker's rare, very stale
  updates small, and they are counted as worth nothing (`discarded`) rather than charged to every update.
- `ringmaster` (`Ringmaster`): asgd whose shards discard a gradient R or more versions stale (R = the workers, the
  default of --max-delay). Sorted by step time, the k fastest are kept while the k-th's staleness (U_k - r_k) t_k,
  U_k the updates of the k fastest, stays below R (it only grows with k, and a faster worker's is smaller); the
  others' steps apply nothing, so the staleness of what is applied is k - 1, at most R - 1. Those whose every step
  would be discarded are idle and compute nothing (common/planning/discarded_workers.py, as the scheduler idles
  them); the rest still cost the shards and their links (wasted work).
- `local` (`LocalRounds`): rounds of H local steps (--local-steps), then each worker pushes the delta of its whole
  model and pulls the averaged one: a worker's round is H computes plus its link's pull and push, unpipelined. The
  shards serve the round's n pulls (slowest worker first), then its n pushes as they arrive, so one round takes at
  least 2 n shard services: where one shard bounds the job, local SGD moves the model once per H steps instead of
  once per step. An update (a local step on every worker) is counted as one synchronous step of their summed batch.
- A protocol that waits for its rounds starts with one at the fixed split, before any worker is measured
  (`startup_s`): over a 10 Mbit link that first round can outlast the rest of the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynabatch.common.planning.discarded_workers import discarded_workers, kept_prefix
from dynabatch.common.planning.optimum import NoiseScale
from dynabatch.common.planning.predicted_cluster import Cluster, Node

STALENESS_WEIGHT = 1.0
"""How much of a batch one version of staleness costs an asynchronous update (1: a gradient stale by s versions is
worth its share of a batch of s + 1 updates)."""


@dataclass(frozen=True)
class Throughput:
    """A method's steady state: samples applied per second (discarded ones excluded), the samples one update is
    worth, the mean staleness of what is applied, the fraction of computed samples discarded, and the seconds of
    one round (0: no rounds)."""

    samples_per_s: float
    effective_batch: float
    staleness: float = 0.0
    discarded: float = 0.0
    round_s: float = 0.0


class ProtocolModel:
    """A gradient protocol: a worker's step is its pipelined compute and transfers (`Cluster.step_s`)."""

    equal_steps = False
    """Whether the dynamic policy gives every worker the same step (ProtocolSpec.equal_steps), else batches by speed."""
    waits_for_rounds = False
    """Whether an update waits for every worker's step, so the first, unmeasured round waits for the slowest."""
    leaves_out = False
    """Whether the dynamic policy may give a worker no batch (a sized round's, scheduler/batch_allocation.py
    `allocate_round`); otherwise every worker keeps at least a sample and so its transfers."""
    split_as_predicted = True
    """Whether the scheduler's dynamic split is the one this model predicts, so that `choose` may pick it."""

    def step_s(self, cluster: Cluster, node: Node, batch: float) -> float:
        return cluster.step_s(node, batch)

    def batch_within(self, cluster: Cluster, node: Node, step_s: float) -> float:
        """The largest batch (possibly negative: none) whose step lasts at most `step_s`."""
        return (cluster.compute_within(node, step_s) - node.device.fixed_s) / node.device.per_sample_s

    def idle(self, cluster: Cluster, batches: Sequence[float]) -> set[int]:
        """The workers (indexes) the scheduler would give no batch at `batches`, their steps irrelevant: none."""
        return set()

    def throughput(self, cluster: Cluster, batches: Sequence[float], noise: NoiseScale) -> Throughput:
        """The steady state of `batches`; `noise` (K(B)) for a model that settles what counts by the time to target."""
        raise NotImplementedError

    def startup_s(self, cluster: Cluster, fixed: Sequence[float], steady: Throughput) -> float:
        """What the first round, at the fixed split and before any worker is measured, costs beyond a steady one."""
        if not self.waits_for_rounds:
            return 0.0
        first = max(self.step_s(cluster, n, b) for n, b in zip(cluster.nodes, fixed, strict=True) if b > 0)
        return max(0.0, first - steady.round_s)


def _busy(cluster: Cluster, batches: Sequence[float]) -> list[tuple[Node, float]]:
    return [(n, b) for n, b in zip(cluster.nodes, batches, strict=True) if b > 0]


def counted(noise: NoiseScale, candidates: Sequence[Throughput]) -> Throughput:
    """The candidate that reaches the target first: K(b) b = K_min (b + B_noise) samples at its effective batch b,
    over its samples per second (the first of equals)."""
    return min(candidates, key=lambda t: noise.samples(t.effective_batch) / t.samples_per_s)


class Rounds(ProtocolModel):
    """ssgd: rounds of B samples, each closing when the shards have taken the last push.

    A round's pushes reach the shards as its workers finish, and the shards serve them one after another, so
    workers that finish together (equal steps: LB-BSP) wait for each other's pushes; the pulls that start the
    next round are hidden by the forward pass (the pipeline) and only bound the round through the shards' rate."""

    equal_steps = True
    waits_for_rounds = True
    leaves_out = True

    def throughput(self, cluster: Cluster, batches: Sequence[float], noise: NoiseScale) -> Throughput:
        busy = _busy(cluster, batches)
        closed, service = 0.0, cluster.push_service_s()
        for end in sorted(cluster.step_s(n, b) for n, b in busy):
            closed = max(closed, end) + service
        round_s = max(closed, len(busy) / cluster.max_steps_per_s())
        total = sum(b for _, b in busy)
        return Throughput(total / round_s, total, round_s=round_s)


class Arrivals(ProtocolModel):
    """asgd: every worker at its own pace, the updates bounded by the shards (every step moves the model in and
    out of them), each update as stale as the updates applied while it was computed.

    What counts is the k fastest workers' updates, k the one that reaches the target first (`counted`): a gradient
    stale by tau versions steps lr / tau under the delay step, so the rare, very stale updates of a worker far
    slower than the rest (behind a slow link) move the model little and cost it little, and are counted as worth
    nothing; their versions still make the counted ones staler. Counted so, no prediction falls below T* (a
    k-worker prefix is T*'s term of the k fastest at this batch)."""

    def throughput(self, cluster: Cluster, batches: Sequence[float], noise: NoiseScale) -> Throughput:
        busy = sorted(_busy(cluster, batches), key=lambda nb: cluster.step_s(*nb))
        return counted(noise, self._applied(cluster, busy, every_version=True))

    @staticmethod
    def _applied(cluster: Cluster, busy: list[tuple[Node, float]], every_version: bool) -> list[Throughput]:
        """For each k, `busy` (fastest first) stepping with only the k fastest's gradients counted: every busy
        worker steps (the shards serve them all), each counted gradient as stale as the versions made while it was
        computed, by every busy worker (`every_version`) or by the counted ones alone (the rest discarded before
        they are applied). Running sums, so that many workers cost the scheduler n steps, not n squared."""
        steps = [cluster.step_s(n, b) for n, b in busy]
        computed = sum(b / t for (_, b), t in zip(busy, steps, strict=True))
        versions = sum(1 / t for t in steps)
        slowed = min(1.0, cluster.max_steps_per_s() / versions)
        applied, updates, samples = [], 0.0, 0.0
        for k, ((_, batch), step) in enumerate(zip(busy, steps, strict=True), start=1):
            updates += 1 / step
            samples += batch / step
            made = versions if every_version else updates
            staleness = (k * made - updates) / updates  # sum of r_i (V - r_i) t_i over U
            applied.append(
                Throughput(
                    samples * slowed,
                    samples / updates * (1 + STALENESS_WEIGHT * staleness),
                    staleness,
                    1 - samples / computed,
                )
            )
        return applied


class Ringmaster(Arrivals):
    """Ringmaster ASGD at its default threshold R = the workers: the fastest k whose gradients stay under R
    versions stale are applied; of the others, those whose every gradient would be discarded are idle (`idle`:
    the scheduler gives them no batch, prediction.py `predict`), the rest compute and are discarded; batches sized
    for equal steps under `dynamic` (every worker then as stale as the others, all kept).

    The scheduler's equal-step split is solved on each worker's step fit, which under the fixed split it starts
    with cannot tell a slow link's transfers from its compute; on mixed_links16 it gave the 1 Gbit workers the
    smallest batch and the 100 and 10 Mbit ones 98 to 139 samples, 80 samples/s applied against the 1,417 this
    model predicts (bench/RESULTS.md 19). So ringmaster + dynamic is predicted, and never chosen."""

    equal_steps = True
    split_as_predicted = False

    def idle(self, cluster: Cluster, batches: Sequence[float]) -> set[int]:
        """The workers (indexes) whose every gradient would arrive R or more versions stale at `batches`, R the
        workers, idle ones included (common/planning/discarded_workers.py): the scheduler gives them no batch."""
        steps = {i: cluster.step_s(n, b) for i, (n, b) in enumerate(zip(cluster.nodes, batches, strict=True)) if b > 0}
        return {i for i, d in discarded_workers(steps, len(cluster.nodes)).items() if d.always}

    def throughput(self, cluster: Cluster, batches: Sequence[float], noise: NoiseScale) -> Throughput:
        busy = sorted(_busy(cluster, batches), key=lambda nb: cluster.step_s(*nb))
        kept = kept_prefix([cluster.step_s(*nb) for nb in busy], len(cluster.nodes))
        return self._applied(cluster, busy, every_version=False)[kept - 1]


class LocalRounds(ProtocolModel):
    """local SGD: rounds of H local steps and one whole-model pull and push per worker through the shards."""

    equal_steps = True
    waits_for_rounds = True

    def step_s(self, cluster: Cluster, node: Node, batch: float) -> float:
        """A worker's round: H computes of `batch`, then its push and (next round's) pull over its link."""
        return cluster.local_steps * node.device.seconds(batch) + cluster.transfer_s(node)

    def batch_within(self, cluster: Cluster, node: Node, step_s: float) -> float:
        compute = (step_s - cluster.transfer_s(node)) / cluster.local_steps
        return (compute - node.device.fixed_s) / node.device.per_sample_s

    def throughput(self, cluster: Cluster, batches: Sequence[float], noise: NoiseScale) -> Throughput:
        busy = _busy(cluster, batches)
        service, h = cluster.push_service_s(), cluster.local_steps
        served, arrivals = 0.0, []
        for node, batch in sorted(busy, key=lambda nb: -self.step_s(cluster, *nb)):
            one_way = cluster.transfer_s(node) / 2
            served += service
            arrivals.append(max(served, one_way) + h * node.device.seconds(batch) + one_way)
        closed = served
        for arrival in sorted(arrivals):
            closed = max(closed, arrival) + service
        total = sum(b for _, b in busy)
        return Throughput(h * total / closed, total, round_s=closed)


MODELS: dict[str, ProtocolModel] = {
    "asgd": Arrivals(),
    "ssgd": Rounds(),
    "ringmaster": Ringmaster(),
    "local": LocalRounds(),
}
"""The model of each protocol the predictor covers; common/protocols.py's others are not modelled."""
