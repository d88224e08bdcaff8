"""What `--protocol auto` and `--batch-policy auto` are shown when they choose (auto_policy.py): which workers count
as measured, or measured enough for an early choice, their step models and caps, and the predictor's cluster of them
with their links and the shards apart (measured_cluster.py); or, before any step, their start-up probes and first
pushes. The allocator decides and hands out batches by what auto chose; this decides what auto sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dynabatch.common.config import JobConfig
from dynabatch.common.planning.predicted_cluster import Cluster
from dynabatch.common.protocols import ProtocolSpec
from dynabatch.scheduler.auto_policy import EARLY_STEPS, MEASURED_STEPS, AutoPolicy, measured_workers
from dynabatch.scheduler.idle_workers import IdleWorkers
from dynabatch.scheduler.measured_cluster import MeasuredWorker, TransferTally, measured_cluster
from dynabatch.scheduler.speed_model import SpeedModel, StepModel


@dataclass(frozen=True)
class AutoInputs:
    """The measurements `auto` chooses on: the allocator's speed models (`speeds`, by worker id, the allocator's own
    dict), its tally of the shards' reports (`tally`) and the workers the idle rule left out (`idled`)."""

    auto: AutoPolicy
    job: JobConfig
    speeds: dict[str, SpeedModel]
    tally: TransferTally
    idled: IdleWorkers

    def revisit(self, ready: dict[str, int], allocation: dict[str, int], spec: ProtocolSpec, round_steps: int) -> bool:
        """Let auto choose again from the `ready` workers (id: its own largest batch) that have reported
        MEASURED_STEPS steps (or are idle: they report no more, and their last measured speed is what the idle rule
        judges them on too), or, where every one has reported EARLY_STEPS, from all of them with a margin as wide as
        their fewest steps call for (auto_policy.py), or, before that, on their probes and first pushes
        (`_on_probes`); `allocation` is the split they hold, `spec` the protocol they step under and `round_steps`
        the steps one of their reported steps stands for. True when auto's policy changed."""
        fits = {wid: (self.speeds[wid].observations, self.speeds[wid].fit()) for wid in ready}
        observed = {
            wid: (n, fit.step_seconds(max(1, allocation.get(wid, 0))))
            for wid, (n, fit) in fits.items()
            if fit is not None
        }
        measured = measured_workers(observed, min(MEASURED_STEPS, self.job.speed_window))
        idle = sorted(w for w in self.idled.idle if w in observed and w not in measured)  # no more steps will come
        measured += idle
        early = set(measured) | {wid for wid, (n, _) in observed.items() if n >= EARLY_STEPS}
        if not measured and len(early) < len(ready) and self.choosing_on_probes(allocation, spec):
            return self._on_probes(ready)
        chosen_on = sorted(early) if len(measured) < len(ready) == len(early) else measured
        models = {wid: model for wid in chosen_on if (model := self.speeds[wid].overhead_fit()) is not None}
        caps = self._caps(ready, models)
        early_ones = set(models) - set(measured)
        return self.auto.revisit(
            models,
            caps,
            len(ready) - len(models),
            self._measured(models, caps, round_steps),
            len(early_ones),
            min((observed[wid][0] for wid in early_ones), default=MEASURED_STEPS),
        )

    def choosing_on_probes(self, allocation: dict[str, int], spec: ProtocolSpec) -> bool:
        """Whether auto may still choose on the probes and first pushes (`_on_probes`): under `--protocol auto` (the
        tier is there for the protocol: a shard that bounds asgd's steps), before its first choice, on the gradient
        steps `spec` takes, while a worker holding a batch of `allocation` has reported no step."""
        auto = self.auto
        if not auto.modelled or len(auto.protocols) < 2 or auto.choices or spec.local_steps:
            return False
        return any(self.speeds[w].observations == 0 for w, b in allocation.items() if b and w in self.speeds)

    def _on_probes(self, ready: dict[str, int]) -> bool:
        """Let auto choose on the `ready` workers' start-up probes (their compute curves) and first pushes (the
        shards' reports, ShardHeartbeat.pushed) with the shards' service time on their own count of transfers, once
        all are known (EARLY_MARGINS' margin for 0 steps).

        A worker's first push reached the shards a pull (its wait and service at the shards, and its link), a
        compute of its first batch and a push's link after that batch was handed out. Less that compute by the probe
        it is what a gradient step spends not computing, but for the push's wait at the shards: measured_cluster.py
        takes two of the shards' holds off it (a step's pull and push), so one is given back. The batch's way to
        the worker and the shard's report of the push each lag by up to a heartbeat and count as link, so a link is
        taken longer than it is: a protocol whose rounds wait for the slowest link is chosen only where it wins even
        so. A probe reads a worker's compute under the start-up's contention, slow by tens of percent
        (bench/simulate.py `probe`), which takes some of that back. True when the policy changed."""
        load, pushed = self.tally.load(), self.tally.first_push
        curves = {wid: self.speeds[wid].probe_curve() for wid in ready}
        probed = {wid: curve for wid, curve in curves.items() if curve is not None and wid in pushed}
        if load is None or len(probed) < len(ready):
            return self.auto.revisit({}, {}, len(ready))
        caps = self._caps(ready, probed)
        workers = {
            wid: MeasuredWorker(
                curve, max(0.0, pushed[wid][0] - curve.step_seconds(pushed[wid][1])) + load.held_s(), caps[wid]
            )
            for wid, curve in probed.items()
        }
        return self.auto.revisit(probed, caps, 0, self._cluster(workers, 1), len(probed), 0)

    def _caps(self, ready: dict[str, int], workers: Iterable[str]) -> dict[str, int]:
        """Each of `workers`' largest batch: its own (`ready`'s; 0: none) within the job's --max-batch."""
        return {wid: min(self.job.max_batch, ready[wid] or self.job.max_batch) for wid in workers}

    def _measured(self, models: dict[str, StepModel], caps: dict[str, int], round_steps: int) -> Cluster | None:
        """The measured workers with their compute, links and the shards apart (measured_cluster.py); None where
        one reported no compute time, or none is measured."""
        if not models:
            return None
        workers = {}
        for wid in models:
            compute, overhead = self.speeds[wid].compute_curve(), self.speeds[wid].overhead_s()
            if compute is None or overhead is None:
                return None
            workers[wid] = MeasuredWorker(compute, overhead, caps[wid])
        return self._cluster(workers, round_steps)

    def _cluster(self, workers: dict[str, MeasuredWorker], round_steps: int) -> Cluster:
        """The predictor's cluster of `workers`, a reported step of theirs standing for `round_steps` steps."""
        job = self.job
        return measured_cluster(
            workers,
            self.tally.load(),
            self.tally.model_bytes,
            job.global_batch,
            round_steps,
            job.local_steps,
            job.chunk_bytes,
            job.min_batch,
        )
