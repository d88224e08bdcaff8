"""Who trains how much: each worker's speed model, the batch split, AdaComm's local steps, and their decisions.

The allocator is the one owner of a worker's batch (`batch_of`): its assignment,
STATUS and the metrics all read it there, so none can show a batch the worker was
not given. It also allots the job's sample budget (`allot`): each worker may
train up to its allotment and no more, so the job trains the epochs it was asked
for, its last batches sized to what is left. The pure solvers are in batch_allocation.py, speed_model.py and
local_steps.py; this class keeps their inputs and results between heartbeats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dynabatch.common.allotment import allotted_batch, floored
from dynabatch.common.config import JobConfig
from dynabatch.common.probe import probe_batch
from dynabatch.common.protocols import ProtocolSpec, RingmasterSettings
from dynabatch.common.wire.messages import Decision, ShardHeartbeat, WorkerHeartbeat
from dynabatch.scheduler.auto_inputs import AutoInputs
from dynabatch.scheduler.auto_policy import AUTO, AutoPolicy
from dynabatch.scheduler.batch_allocation import allocation_for, bounds_note, fixed_allocation, needs_reassign
from dynabatch.scheduler.efficient_batches import efficient_batches
from dynabatch.scheduler.idle_workers import IdleWorkers
from dynabatch.scheduler.local_steps import adacomm_steps
from dynabatch.scheduler.measured_cluster import TransferTally
from dynabatch.scheduler.saved_progress import SavedProgress, SavedSpeed
from dynabatch.scheduler.speed_model import SpeedModel, StepModel

DECISIONS_KEPT = 100
HANDED_KEPT = 16  # assignments a worker may still step with that are remembered apart; older ones are folded in
MIN_OWN_STEP_S = 1e-6
ALLOT_AHEAD = 4  # pushes a worker is allotted beyond the samples it reported, so it never waits for an answer


def own_step_seconds(hb: WorkerHeartbeat) -> float:
    """The part of a worker's step its speed model fits: everything but waiting for other workers.

    Waiting for others (an ssgd round, a local average) says nothing about the
    worker's speed, and fitting it would make every worker in a round look as
    slow as the slowest. Waiting for data (`data_s`) is the worker's own: a
    starved loader makes that machine slower at every batch size, exactly as a
    slow GPU does, so it stays in, and a worker whose loader cannot keep up gets
    a smaller share.
    """
    return max(hb.times.step_s - hb.times.wait_s, MIN_OWN_STEP_S)


def own_compute_seconds(hb: WorkerHeartbeat) -> float | None:
    """The part of a worker's step that grows with its batch and nothing else: computing and taking its samples
    (`compute_s + data_s`); None when the worker reports no compute time (an older worker).

    A worker's `compute_s` is its forward and backward pass (with its node's emulated slowdown) and nothing it
    waits for: its batch is drawn before the timer starts (that time is `data_s`), a prefetched pull's chunks
    arrive beside it and are waited for in the pull's time, and a pipelined step counts its waits for chunks as
    pull and push (only loading arrived chunks and sending gradient ones, both small, stay in its compute).
    Taking the samples is the worker's own, as in `own_step_seconds`: a starved loader makes every sample cost
    more, so it stays in. It is at most `own_step_seconds` (the phases sum to the step): a report that says
    otherwise does not make its worker look slower than its whole step does.
    """
    return min(hb.times.compute_s + hb.times.data_s, own_step_seconds(hb)) if hb.times.compute_s > 0 else None


class Allocator:
    """Allocation: the speed models, the batch split and the batches handed out, local steps, and every decision."""

    def __init__(self, job: JobConfig, spec: ProtocolSpec, protocols: Sequence[str] = ()) -> None:
        """`protocols`: those `--protocol auto` may switch among (empty: the job's protocol is fixed); `spec` is
        the one the workers step under, which the job's state replaces when they switch."""
        self.job = job
        self.spec = spec
        self.speeds: dict[str, SpeedModel] = {}  # by worker id, from its first report of its standalone speed
        self.resumed_speeds: dict[str, SavedSpeed] = {}  # speed models of a saved job, by HELLO instance
        self.allocation: dict[str, int] = {}
        self.told: dict[int, dict[str, int]] = {}  # by shard slot: the push bounds it last reported applied
        self.handed: dict[str, dict[int, int]] = {}  # by worker: the batch handed per assignment it may step with
        self.assignment_id = 0
        self.decisions: list[Decision] = []
        self.local_steps = job.local_steps
        self.local_steps_reason = "configured H"
        self.idled = IdleWorkers()  # workers Ringmaster would always discard, given no batch (idle_workers.py)
        self.tally = TransferTally()  # the transfers made and the shards' serving seconds (measured_cluster.py)
        self.first_loss: float | None = None  # AdaComm's reference: the smoothed loss when it first was known
        self.training_started_at: float | None = None  # when the first batches were handed out
        self.allotted: dict[str, int] = {}  # by live worker: the samples it may have trained in all (its own count)
        self.left: dict[str, int] = {}  # by live worker: what its allotment leaves beyond the samples it reported
        self.unallotted: int | None = None  # samples of the job not yet allotted (None: the budget is not known yet)
        self.rounds_from: dict[str, int] = {}  # by worker: its step count when the protocol that runs took effect
        self.auto = (
            AutoPolicy(spec, job.global_batch, job.aggregation, protocols, job.batch_policy, job.min_batch)
            if job.batch_policy == AUTO or len(protocols) > 1
            else None
        )
        self.auto_inputs = (
            AutoInputs(self.auto, job, self.speeds, self.tally, self.idled) if self.auto is not None else None
        )

    @property
    def training_started(self) -> bool:
        return self.training_started_at is not None

    def switch(self, spec: ProtocolSpec, steps: dict[str, int]) -> None:
        """Decide for protocol `spec` from now on (`--protocol auto` switched the workers to it); `steps` is every
        live worker's reported step count. A lockstep protocol's leads count in its own rounds, from these counts: what
        each worker trained before, at its own pace under an asynchronous protocol, is no round it is behind by.
        The speed models measure anew (`SpeedModel.restart`): a step under the old protocol held its transfers in
        another proportion, so the new protocol's split is solved on the compute and the transfers it will pay, and
        on its own steps once they are reported."""
        ratio = self._round_steps() / (self.local_steps if spec.local_steps else 1)
        self.spec = spec
        self.rounds_from = dict(steps)
        for model in self.speeds.values():
            model.restart(ratio)

    def measure(
        self, worker: str, standalone_sps: float, instance: str, fixed_s: float = 0.0, own_max_batch: int = 0
    ) -> None:
        """Start `worker`'s speed model from its start-up probe, its standalone speed and fixed seconds per step at
        the probe's batch (common/probe.py's, from the job's and the worker's own --max-batch), and the steps a
        saved job's model of the same process had seen."""
        batch = probe_batch(self.job.max_batch, own_max_batch)
        model = SpeedModel(self.job.speed_window, self.job.speed_forgetting, standalone_sps, fixed_s, batch)
        saved = self.resumed_speeds.pop(instance, None)
        for batch, seconds in saved.observations if saved is not None else []:
            model.observe(batch, seconds)
        self.speeds[worker] = model

    def observe(self, worker: str, hb: WorkerHeartbeat) -> None:
        """Fit a step the worker reports into its speed model, with the compute time it reports."""
        self.speeds[worker].observe(hb.batch, own_step_seconds(hb), own_compute_seconds(hb))
        self.tally.stepped(worker, hb.steps, hb.bytes, self._round_steps())

    def forget(self, worker: str) -> None:
        """A worker that left: its speed model goes (a process that registers again gets a new id)."""
        self.speeds.pop(worker, None)
        self.idled.forget(worker)
        self.tally.forget(worker)
        self.handed.pop(worker, None)
        self.allotted.pop(worker, None)
        self.left.pop(worker, None)

    def hand(self, worker: str, batch: int) -> None:
        """`worker` was just told `batch` under the current assignment: until it reports a step under a later
        one, it may be stepping with it, so its pushes are bounded by it (`push_bounds`)."""
        handed = self.handed.setdefault(worker, {})
        handed[self.assignment_id] = max(batch, handed.get(self.assignment_id, 0))
        if len(handed) > HANDED_KEPT:  # a worker that heartbeats but reports no step: fold the oldest into the next
            oldest, following = sorted(handed)[:2]
            handed[following] = max(handed.pop(oldest), handed[following])

    def stepped(self, worker: str, assignment_id: int) -> None:
        """`worker` reports that it steps under `assignment_id` (its last step's, or, while it awaits a batch, the
        assignment it holds): it steps with no batch handed before that one (its steps take assignments in order),
        so those no longer bound its pushes, nor keep its allotment (`allot`)."""
        handed = self.handed.get(worker, {})
        for old in [i for i in handed if i < min(assignment_id, self.assignment_id)]:
            del handed[old]

    def shard_reported(self, shard: int, hb: ShardHeartbeat, since_batch_s: dict[str, float]) -> None:
        """A shard's serving figures, and the push it names of each worker holding a batch, `since_batch_s[w]` after
        that worker's first batch (of workers holding one only: a forged list holds no memory)."""
        self.tally.shard_reported(shard, hb.busy_s, hb.queued_s, hb.transfers)
        for wid in hb.pushed:
            if self.allocation.get(wid) and wid in since_batch_s:
                self.tally.pushed(wid, since_batch_s[wid], self.allocation[wid])

    def forget_shard(self, index: int) -> None:
        """A shard slot whose process left: what it was told goes with it (a new one is told afresh)."""
        self.told.pop(index, None)

    def allot(self, worker: str, samples: dict[str, int], steps: dict[str, int], budget: int) -> None:
        """Allot `worker` samples out of `budget`, the samples the job has yet to train beyond those of workers
        that left; `samples` and `steps` are every live worker's reported counts.

        A worker is allotted ALLOT_AHEAD pushes beyond what it reported, so that it never waits for an answer
        while the budget lasts. Once what is unallotted no longer covers every worker's lead, it is split at once
        among the workers holding a batch, in proportion to what each lacks (its batch, at equal lead): their
        last batches are sized to what is left, and they finish together. An allotment never shrinks while its
        worker may be stepping with it (`_may_step`); what a worker that left did not use goes back to the job, and
        so does what a worker left out with batch 0 did not, once it reports that it holds its batch 0: a step it
        took under an earlier answer may land after the answer that left it out, and counts against its own
        allotment, not against what the others were given meanwhile.

        Where every round takes one push of every worker (`lockstep`: ssgd, local, msd), the reports lag one another
        by up to a round: a lead counts from the most advanced report (in rounds since the protocol took effect,
        `switch`, counted in reported steps: a dynamic split changes a worker's push, so its samples over its push
        now are not its rounds), and the split hands out whole pushes to the worker whose allotment is fewest rounds
        long (`levelled`, its rounds trained plus what it has left in pushes at its batch now), so that every worker
        ends at the same round and no round past it trains one worker's remainder alone. A share that would leave
        its worker less than one push of MIN_BATCH samples a step is folded into another's (common/allotment.py,
        `floored`).
        """
        have = {w: max(self.allotted.get(w, 0) if self._may_step(w) else 0, n) for w, n in samples.items()}
        unallotted = max(0, budget - sum(have.values()))
        pushes = {w: self.push_samples(w) for w in samples}
        reported = dict(samples)
        rounds = self._rounds(steps, samples)
        if self.spec.lockstep:
            ahead = max((rounds[w] for w in samples if pushes[w] > 0), default=0)
            reported = {w: n + max(0, ahead - rounds[w]) * pushes[w] for w, n in samples.items()}
        lacking = {w: max(0, reported[w] + ALLOT_AHEAD * pushes[w] - have[w]) for w in samples}
        if unallotted >= sum(lacking.values()):
            have[worker] = have.get(worker, 0) + lacking.get(worker, 0)
        else:
            split = (
                levelled(
                    unallotted,
                    {w: rounds[w] * pushes[w] + have[w] - samples[w] for w in lacking if lacking[w] > 0},
                    pushes,
                )
                if self.spec.lockstep
                else shares(unallotted, lacking)
            )
            left = {w: have[w] - n for w, n in samples.items()}
            for w, share in floored(split, left, self.spec.report_steps(self.local_steps)).items():
                have[w] += share
        self.allotted = have
        self.left = {w: have[w] - n for w, n in samples.items()}
        self.unallotted = max(0, budget - sum(have.values()))

    def _rounds(self, steps: dict[str, int], samples: dict[str, int]) -> dict[str, int]:
        """The rounds each worker of `samples` reported since the protocol now running took effect (a round: one push,
        of H steps under a local protocol)."""
        since = {w: steps.get(w, 0) - min(steps.get(w, 0), self.rounds_from.get(w, 0)) for w in samples}
        return {w: n // self._round_steps() for w, n in since.items()}

    def _may_step(self, worker: str) -> bool:
        """Whether `worker` holds a batch, or may still be stepping under an answer that gave it one: a batch was
        handed to it under an assignment no older than the one it last reported stepping under (`stepped`)."""
        return self.allocation.get(worker, 0) > 0 or any(b > 0 for b in self.handed.get(worker, {}).values())

    def _allotment_left(self, worker: str) -> int | None:
        """What `worker` may still train once the whole budget is allotted (None before: its next answer allots it
        its lead, whatever its allotment now)."""
        return self.left.get(worker, 0) if self.unallotted == 0 else None

    def push_samples(self, worker: str) -> int:
        """The samples of one push of `worker` at its allocation: its batch times the local steps a push covers."""
        return self.allocation.get(worker, 0) * (self.local_steps if self.spec.local_steps else 1)

    def reallocate(
        self, now: float, t: float, reason: str, subject: str, ready: dict[str, int], force: bool = False
    ) -> list[str]:
        """Re-solve the batch split among the `ready` workers (id -> its own largest batch, 0: none); `reason` is a
        bounded label, `subject` the worker behind it, `t` the job's time. Returns the workers now given a batch
        after holding none."""
        job = self.job
        if not ready or (not self.allocation and len(ready) < job.min_workers and not self.training_started):
            self.allocation = {}
            return []
        if self.training_started_at is None:
            self.training_started_at = now
        fits = {wid: self.speeds[wid].fit() for wid in ready}
        models = {wid: model for wid, model in fits.items() if model is not None}  # those with a step model
        caps = {wid: cap for wid, cap in ready.items() if cap > 0}
        policy = job.batch_policy
        if self.auto is not None:
            if self._revisit_auto(ready):
                force, reason = True, f"{reason}; auto chose {self.auto.policy}"
            policy = self.auto.policy
        proposed = self._split(sorted(ready), models, caps, policy if len(models) == len(fits) else "fixed")
        if self.idled.judge(self._discarding_steps(models, proposed, len(ready)), self._max_delay(len(ready))):
            force = True
        notes = [reason, bounds_note(proposed, job.global_batch)]
        if self.idled.idle:  # the others keep their batches: idling changes nothing for them but what they share
            proposed = {**proposed, **{wid: 0 for wid in self.idled.idle}}
            notes.append("idle: Ringmaster would discard their steps")
        if not force and not needs_reassign(self.allocation, proposed, job.reassign_threshold):
            return []
        if proposed == self.allocation:
            return []
        previous, self.allocation = self.allocation, proposed
        given = [wid for wid, b in proposed.items() if b > 0 and not previous.get(wid, 0)]
        predicted = {wid: models[wid].step_seconds(b) for wid, b in proposed.items() if wid in models and b > 0}
        if any(b == 0 for wid, b in proposed.items() if wid not in self.idled.idle):
            notes.append("slowest left out: the round is faster without them (batch 0)")
        self._decide(Decision(t, "; ".join(n for n in notes if n), subject, dict(proposed), predicted))
        return given

    def _split(self, ids: list[str], models: dict[str, StepModel], caps: dict[str, int], policy: str) -> dict[str, int]:
        """The batch split of B among `ids` under `policy` (`models`: their step models, every one measured unless
        the policy is fixed)."""
        job = self.job
        if policy == "fixed":
            return fixed_allocation(ids, job.global_batch, job.min_batch, job.max_batch, caps)
        if policy == "efficient":
            overheads = {wid: self.speeds[wid].overhead_fit() or model for wid, model in models.items()}
            return efficient_batches(overheads, job.global_batch, job.min_batch, job.max_batch, caps)
        return allocation_for(self.spec)(
            self._split_models(models), job.global_batch, job.min_batch, job.max_batch, caps
        )

    def _max_delay(self, live: int) -> int:
        """Ringmaster's R with `live` workers, idle ones included (0 where the protocol that runs is not Ringmaster)."""
        settings = self.spec.settings.from_job(self.job)
        return settings.threshold(live) if isinstance(settings, RingmasterSettings) else 0

    def _discarding_steps(
        self, models: dict[str, StepModel], everyone: dict[str, int], live: int
    ) -> dict[str, float] | None:
        """Each measured worker's predicted step at `everyone`'s split (the one idle workers included would get),
        which Ringmaster's rule judges (idle_workers.py); None where the protocol that runs discards nothing for its
        delay."""
        if not self._max_delay(live):
            return None
        return {wid: models[wid].step_seconds(b) for wid, b in everyone.items() if wid in models and b > 0}

    def _revisit_auto(self, ready: dict[str, int]) -> bool:
        """Let auto choose again on what it is shown of the `ready` workers (auto_inputs.py); True when its policy
        changed. Once the whole budget is allotted the job ends under what runs: the workers that trained their
        allotment are no longer measured, and a choice over the rest would switch for nothing."""
        assert self.auto_inputs is not None
        return self.unallotted != 0 and self.auto_inputs.revisit(ready, self.allocation, self.spec, self._round_steps())

    def choosing_on_probes(self) -> bool:
        """Whether a shard's report may let auto choose before the first step (AutoInputs.choosing_on_probes)."""
        return self.auto_inputs is not None and self.auto_inputs.choosing_on_probes(self.allocation, self.spec)

    def _round_steps(self) -> int:
        """The steps one reported step stands for in transfers: a local round's H, else 1."""
        return self.local_steps if self.spec.local_steps else 1

    def _split_models(self, models: dict[str, StepModel]) -> dict[str, StepModel]:
        """What the dynamic split solves with: the step models where steps are to be equal, else each worker's
        compute-only model (`allocate_compute` takes ``c_i`` alone, and the one the worker reports is known from
        its first step, while the step fit's includes its transfers until it has identified ``a_i``)."""
        if self.spec.equal_steps:
            return models
        return {wid: self.speeds[wid].compute_fit() or model for wid, model in models.items()}

    def adapt_local_steps(self, t: float, loss: float, workers: list[WorkerHeartbeat]) -> None:
        """AdaComm's H from the smoothed `loss`, bounded by the live workers' measured sync/compute ratio."""
        if self.first_loss is None and math.isfinite(loss):
            self.first_loss = loss
        sync_s = max((w.sync_s for w in workers), default=0.0)
        compute_s = min((w.times.compute_s for w in workers if w.times.compute_s > 0), default=0.0)
        first = math.nan if self.first_loss is None else self.first_loss
        decision = adacomm_steps(self.job.local_steps, self.local_steps, first, loss, sync_s, compute_s)
        if decision.steps != self.local_steps:
            self.local_steps, self.local_steps_reason = decision.steps, decision.reason
            self._decide(
                Decision(t, "local steps", f"H={decision.steps}: {decision.reason}", dict(self.allocation), {})
            )

    def _decide(self, decision: Decision) -> None:
        """Every decision is a new assignment; the newest DECISIONS_KEPT are kept for STATUS and the log."""
        self.assignment_id += 1
        self.decisions.append(decision)
        del self.decisions[:-DECISIONS_KEPT]

    @property
    def holding_batch(self) -> int:
        """Workers the allocation gives a batch (DBS-SGD's n): not those left out with batch 0."""
        return sum(1 for b in self.allocation.values() if b > 0)

    def idle_workers(self) -> list[str]:
        """Workers the allocation leaves out (batch 0), and those that have trained their allotment: no round waits
        for them."""
        return sorted(w for w, b in self.allocation.items() if b == 0 or self._trained_allotment(w))

    def _trained_allotment(self, worker: str) -> bool:
        """Whether `worker` has trained all it may: the budget is allotted and its own allotment used up."""
        left = self._allotment_left(worker)
        return left is not None and left <= 0

    def push_bounds(self, live: list[str]) -> dict[str, int]:
        """Each live worker's largest batch: its allocation's, or the largest it was handed under an assignment it
        may still be stepping with. A shard refuses a PUSH of more samples (times the local steps a delta covers)
        than its sender's, so the bound must cover every batch the sender can be using however many decisions
        came since it last reported a step; and a shard that restarts learns it whole from this one answer."""
        return {
            w: max(self.allocation.get(w, 0), *self.handed.get(w, {}).values(), 0)
            for w in (self.handed.keys() | self.allocation.keys()) & set(live)
        }

    def tell(self, shard: int, batches: dict[str, int]) -> None:
        """The push bounds shard slot `shard` reports it applied (ShardHeartbeat.batches)."""
        self.told[shard] = batches

    def answered(self, shard: int) -> None:
        """Shard slot `shard` was sent an answer, with live workers it may apply at once: from now on it bounds
        every worker's batch by the bounds it reports applied, none until it reports."""
        self.told.setdefault(shard, {})

    def batch_of(self, worker: str) -> int:
        """The batch `worker` holds: its allocation, or less while a live shard has not yet reported that it may
        push that much (a worker is given a larger batch only once the shards bound its pushes by it). A shard
        never answered is not waited on: it takes no push before it learns the live workers, and their bounds,
        in that same answer. Its last push is sized to what its allotment leaves (`allot`; 0 once it is used up).
        The one owner of a worker's batch: its assignment, STATUS and the metrics read it."""
        batch = min([self.allocation.get(worker, 0), *(told.get(worker, 0) for told in self.told.values())])
        return allotted_batch(batch, self._allotment_left(worker), self.spec.report_steps(self.local_steps))

    def restore(self, saved: SavedProgress, training_started_at: float | None) -> None:
        """Go on from a saved job: when it started training (None: not yet), its decisions' count, its H, its first
        loss and the speed models it had."""
        if training_started_at is not None:
            self.training_started_at = training_started_at
        self.assignment_id = saved.assignment_id
        self.local_steps, self.local_steps_reason = saved.local_steps or self.local_steps, saved.local_steps_reason
        self.first_loss = saved.first_loss
        self.resumed_speeds = dict(saved.speeds)

    def saved_speeds(self, instances: dict[str, tuple[str, float]]) -> dict[str, SavedSpeed]:
        """The speed models to save, by HELLO instance (`instances`: instance -> (worker id, standalone speed)),
        those of a saved job not yet claimed included, at most --max-workers of them."""
        speeds = {
            instance: SavedSpeed(sps, self.speeds[wid].window())
            for instance, (wid, sps) in instances.items()
            if wid in self.speeds
        }
        return dict(list({**self.resumed_speeds, **speeds}.items())[-self.job.max_workers :])


def levelled(total: int, have: dict[str, int], pushes: dict[str, int]) -> dict[str, int]:
    """`total` handed out a push at a time (`pushes`: each worker's samples per push) to the worker whose
    allotment `have` is fewest pushes long (ties by id), the last push cut to what is left: workers of equal
    rounds end at the same round."""
    out = {w: 0 for w in have}
    pushing = sorted(w for w in have if pushes.get(w, 0) > 0)
    left = total
    while left > 0 and pushing:
        w = min(pushing, key=lambda k: ((have[k] + out[k]) / pushes[k], k))
        give = min(pushes[w], left)
        out[w] += give
        left -= give
    return out


def shares(total: int, weights: dict[str, int]) -> dict[str, int]:
    """`total` split in proportion to `weights` (floors, the remainder to the largest fractions), none above its
    weight."""
    whole = sum(weights.values())
    if whole <= 0:
        return {w: 0 for w in weights}
    total = min(total, whole)
    exact = {w: total * n / whole for w, n in weights.items()}
    out = {w: math.floor(x) for w, x in exact.items()}
    for w in sorted(exact, key=lambda k: out[k] - exact[k])[: total - sum(out.values())]:
        out[w] += 1
    return out
