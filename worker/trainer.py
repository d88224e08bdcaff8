"""The training worker: pull, forward/backward, push, heartbeat, repeat.

A step is timed from the start of the pull to the last push acknowledgement;
that is the time the scheduler equalizes across workers. The worker measures
its standalone speed before it joins, so the scheduler can size its first
batch from it rather than from a guess. The process around it (registration,
heartbeats, metrics server) is role_process.py's, what joining brings (job,
model, shards) joined.py's, and each protocol's step a loop's (step_context.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynabatch.common.allotment import allotted_batch, batch_problem
from dynabatch.common.flags import ConfigError
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.planning.protocol_switch import switch_to
from dynabatch.common.probe import probe_batch, probe_steps, probed
from dynabatch.common.protocols import GRADIENT, protocol_spec
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.wire.chunking import travelling
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import WorkerAssignment, WorkerHeartbeat
from dynabatch.common.wire.step_times import PHASES
from dynabatch.schedule import Schedule
from dynabatch.worker.batch_source import DatasetBatches, to_device, worker_order
from dynabatch.worker.heartbeats import NeverAdmitted, heartbeat_after, never_admitted
from dynabatch.worker.joined import Joined
from dynabatch.worker.loader_batches import LoaderBatches
from dynabatch.worker.loops import LOOPS
from dynabatch.worker.micro_batches import micro_batches
from dynabatch.worker.options import WorkerOptions
from dynabatch.worker.role_process import RoleProcess
from dynabatch.worker.step_context import StepContext, StepLoop
from dynabatch.worker.step_result import StepResult

log = logging.getLogger("dynabatch.worker")
SKIP_LOG_EVERY = 100  # a run of skipped steps is logged at its first step and every this many after
DISCARDED = (ErrorCode.TOO_STALE, ErrorCode.HELD, ErrorCode.SWITCHED)
"""The answers to a step that are no error: the shards discarded its gradient and nothing changed; the worker pulls
again at once (counted in `dynabatch_worker_discarded_steps` by reason and in HEARTBEAT.discarded)."""
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    """The trainer's series, on its process's registry, labelled with its id at joining."""

    def __init__(self, registry: CollectorRegistry, worker: str) -> None:
        self.phase = Histogram(
            "dynabatch_worker_phase_seconds",
            "Time per step phase.",
            ["worker", "phase"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.steps = Counter(
            "dynabatch_worker_steps", "Training steps completed.", ["worker"], registry=registry
        ).labels(worker)
        self.samples = Counter(
            "dynabatch_worker_samples", "Training samples processed.", ["worker"], registry=registry
        ).labels(worker)
        self.batch = Gauge(
            "dynabatch_worker_current_batch_size", "Batch size in use.", ["worker"], registry=registry
        ).labels(worker)
        self.loss = Gauge(
            "dynabatch_worker_train_loss", "Training loss of the last step.", ["worker"], registry=registry
        ).labels(worker)
        self.standalone = Gauge(
            "dynabatch_worker_standalone_samples_per_second",
            "Speed measured alone before joining (slowdown included).",
            ["worker"],
            registry=registry,
        ).labels(worker)
        self.errors = Counter(
            "dynabatch_worker_request_errors",
            "Shard requests that failed and were retried.",
            ["worker", "code"],
            registry=registry,
        )
        self.errors.labels(worker, "timeout")  # exported at 0 from the start: a dashboard shows 0, not "No data"
        self.skipped = Counter(
            "dynabatch_worker_skipped_steps",
            "Steps whose gradient was not pushed, by reason.",
            ["worker", "reason"],
            registry=registry,
        )
        self.skipped.labels(worker, "non_finite_loss")
        self.discarded = Counter(
            "dynabatch_worker_discarded_steps",
            "Steps whose gradient the shards answered without applying it, by reason: too_stale (computed on too "
            "old a model: ssgd, msync, ringmaster, rennala), held (ahead of the other workers before the direction "
            "check could vouch for it), switched (the protocol changed while it was on its way).",
            ["worker", "reason"],
            registry=registry,
        )
        for reason in DISCARDED:
            self.discarded.labels(worker, reason.value)
        self.worker = worker


def train_step(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    clip_grad_norm: float | None = None,
    micro_batch: int = 0,
) -> float:
    """Forward and backward over `batch`; leaves the (clipped) gradients on the parameters, returns the loss.

    With `micro_batch` M > 0 a larger batch runs as passes of at most M samples
    whose gradients accumulate, each pass's loss weighted by its share of the
    batch (micro_batches.py): the gradient and the returned loss are the whole
    batch's mean, and clipping applies to the accumulated gradient.
    """
    model.zero_grad(set_to_none=False)
    shares = []
    for part, share in micro_batches(batch, micro_batch):
        loss = loss_fn(model, part)
        torch.autograd.backward(loss if share == 1.0 else loss * share)  # Tensor.backward is untyped in torch
        shares.append(loss.detach() * share)
    if clip_grad_norm:
        torch.nn.utils.clip_grad_norm_(travelling(model), clip_grad_norm)
    return float(sum(shares))


class Worker:
    """A training worker: steps its protocol's loop on the batches the scheduler assigns, as this node's emulated
    hardware would, and reports every step; the process around it is a RoleProcess, the job a Joined."""

    def __init__(self, opts: WorkerOptions, process: RoleProcess, joined: Joined) -> None:
        self.opts = opts
        self.process = process
        self.joined = joined
        self.m = WorkerMetrics(process.registry, joined.id)
        self.slowdown = Slowdown.parse(opts.slowdown)
        self.started = time.monotonic()
        self.skipped = 0  # steps not pushed because their loss was not finite (HEARTBEAT.skipped)
        self.skipped_in_a_row = 0  # since the last step that was pushed: what the log says
        self.discarded = 0  # steps whose push the shards answered without applying it (HEARTBEAT.discarded)
        self._check_micro_batching()
        data, collate = joined.train_data, joined.task.collate_fn()
        order = worker_order(len(data), joined.job.seed, joined.number)  # this worker's order of the training set
        self.batches: DatasetBatches | LoaderBatches = (
            LoaderBatches(data, order, collate, opts.loader_workers, joined.job.seed)
            if opts.loader_workers
            else DatasetBatches(data, order, collate)
        )
        self.data_s = 0.0  # the current step's time spent taking its batch (its `data_s` phase)
        self.refused_assignment = -1  # the last assignment refused for its batch (`_batch`): said once

    def step_context(self) -> StepContext:
        """What this worker's protocol loop may use (see step_context.py)."""
        joined = self.joined
        return StepContext(
            job=joined.job,
            model=joined.model,
            layout=joined.layout,
            shards=joined.shards,
            request_timeout_s=self.opts.request_timeout_s,
            next_batch=self.next_batch,
            timed_compute=self.timed_compute,
            loss_fn=joined.loss_fn,
            idle_for_slowdown=self.idle_for_slowdown,
            heartbeat_when_due=self.process.beat.when_due,
            skip_step=self.skip_step,
            schedule=joined.task.schedule or Schedule(),
            buffers=joined.buffers,
            pipelined=self._pipelined(),
        )

    def _pipelined(self) -> bool:
        """Whether this worker's gradient steps overlap pull, compute and push (JobConfig.pipelines)."""
        joined = self.joined
        return protocol_spec(joined.job.protocol).push_kind == GRADIENT and joined.job.pipelines(
            len(joined.layout.chunks), self.opts.micro_batch, joined.task.clip_grad_norm is not None
        )

    def timed_compute(self, batch: Any) -> tuple[float, float]:
        """Run one training step as this node's emulated hardware would: (loss, seconds).

        A factor F adds (F-1) times the step's CPU time as idle time. CPU time,
        not wall time, measures the work: contention on a shared machine
        inflates wall time, and multiplying that by F would make a slow node
        pay for the contention F times while a fast node pays once. This way
        every node pays it once, and the slow node does F times the work.
        """
        task, device = self.joined.task, self.process.device
        wall, cpu = time.perf_counter(), time.thread_time()
        loss = train_step(self.joined.model, batch, self.joined.loss_fn, task.clip_grad_norm, self.opts.micro_batch)
        if device.type == "cuda":  # the loss is in; the backward kernels may not be
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        wall += self.idle_for_slowdown(cpu)
        return loss, wall

    def skip_step(self, loss: float) -> None:
        """A step whose loss is `loss` (not finite) was not pushed: count it, and tell the scheduler with the
        next heartbeat that is due, which judges whether the model diverged (HEARTBEAT.skipped)."""
        beat = self.process.beat
        self.skipped += 1
        self.m.skipped.labels(self.joined.id, "non_finite_loss").inc()
        if self.skipped_in_a_row % SKIP_LOG_EVERY == 0:
            log.error(
                "%s: loss is %s; not pushing this step's gradient (%d skipped in a row; the scheduler rolls "
                "the job back if its model diverged)",
                self.joined.id,
                loss,
                self.skipped_in_a_row + 1,
            )
        self.skipped_in_a_row += 1
        beat.last = replace(beat.last, skipped=self.skipped, loss=loss)
        beat.when_due()

    def idle_for_slowdown(self, cpu_s: float) -> float:
        """Idle (F-1) x `cpu_s` plus the fixed part A for this node's slowdown F:A now; returns the seconds idled.

        The main thread is as silent while it idles as slower hardware would keep
        it computing; the pulse (pulse.py) keeps the worker alive meanwhile.
        """
        idle = self.slowdown.idle_s(time.monotonic() - self.started, cpu_s)
        if idle <= 0.0:
            return 0.0
        time.sleep(idle)
        return idle

    def measure_standalone(self) -> tuple[float, float]:
        """Samples/s of forward+backward alone (slowdown included), the median of timed steps, and the step's fixed
        seconds from a second, smaller batch's median (common/probe.py; 0 where the batch is too small to have one).

        The median, because processes starting beside this one (imports, data loading)
        make single steps slow at random.
        """
        batch = probe_batch(self.joined.job.max_batch, self.opts.max_batch)
        train_step(self.joined.model, self.next_batch(batch), self.joined.loss_fn, micro_batch=self.opts.micro_batch)
        steps = probe_steps(batch, self.opts.probe_steps)
        return probed(steps, [self.timed_compute(self.next_batch(b))[1] for b in steps])

    def next_batch(self, batch: int) -> Any:
        """The next `batch` samples of this worker's own shuffled order of the training set, on its device.

        After a failed step the same samples are used again, so what a worker
        trains on does not depend on when a shard or the scheduler hiccuped.
        The time it takes is added to `data_s`, the step's `data_s` phase.
        """
        start = time.perf_counter()
        out = to_device(self.batches.take(batch), self.process.device)
        self.data_s += time.perf_counter() - start
        return out

    def _check_micro_batching(self) -> None:
        """The pipelined step cannot accumulate passes: its backward pushes each chunk as soon as it is final."""
        job = self.joined.job
        if self.opts.micro_batch and self._pipelined():  # only --pipeline on pipelines beside micro-batches
            raise ConfigError(
                f"--micro-batch {self.opts.micro_batch}: job {job.job!r} runs with --pipeline on, "
                "whose backward pushes each chunk's gradient as soon as it is final, so it cannot "
                "accumulate passes; run this worker without --micro-batch, or the job with "
                "--pipeline auto"
            )

    def train(self) -> int:
        """Train until the job ends or the process is stopped (the protocol's loop, step after step)."""
        joined = self.joined
        micro, loaders = self.opts.micro_batch, self.opts.loader_workers
        log.info(
            "%s: %s, batches %s, %s",
            joined.id,
            f"passes of at most {micro} samples" if micro else "one pass per batch",
            f"loaded ahead by {loaders} processes" if loaders else "loaded in-process",
            f"steps pipelined over {len(joined.layout.chunks)} chunks" if self._pipelined() else "steps not pipelined",
        )
        try:
            return self._train_steps()
        finally:
            self.batches.close()

    def _train_steps(self) -> int:
        joined, link, beat = self.joined, self.process.link, self.process.beat
        standalone, fixed_s = self.measure_standalone()
        self.m.standalone.set(standalone)
        log.info("%s standalone speed %.0f samples/s, %.4f s fixed per step", joined.id, standalone, fixed_s)
        self.batches.step_succeeded()
        hb = beat.last = WorkerHeartbeat(standalone_sps=standalone, standalone_fixed_s=fixed_s)
        joined.shards.protocol = joined.job.protocol
        steps = LOOPS[protocol_spec(joined.job.protocol).worker_loop](self.step_context())
        hb, assignment = self._await_batch(hb)
        beat.rollbacks = assignment.rollbacks if assignment is not None else 0
        self.started = time.monotonic()  # slowdown schedules count from the first batch, not from start-up
        while assignment is not None and not assignment.stop and not self.process.stopping:
            ordered = switch_to(assignment.protocol, joined.job.protocol)
            if ordered is not None:
                steps = self._switch(ordered, steps)
            if assignment.rollbacks > beat.rollbacks:
                hb = self._roll_back(steps, assignment.rollbacks)
            batch = self._batch(assignment, hb)
            if batch == 0:  # left out for now (its fixed cost alone exceeds a round), or its allotment trained: idle
                hb, assignment = self._await_batch(replace(hb, assignment_id=assignment.assignment_id))
                continue
            self.data_s = 0.0
            counted = list(joined.shards.staleness)
            try:
                result = steps.step(replace(assignment, batch=batch))
            except (TimeoutError, RemoteError) as exc:
                code = exc.code if isinstance(exc, RemoteError) else ErrorCode.TIMEOUT
                # A failed step is not counted, so neither are the pushes that live shards took from it: the
                # scheduler refuses more updates than steps x shards (a shard that restarted fails steps for a while).
                joined.shards.staleness = counted
                steps.after_failure(code)
                self.batches.step_failed()
                if code not in DISCARDED:
                    self.m.errors.labels(joined.id, code).inc()
                    log.warning("%s: step failed (%s); retrying", joined.id, exc)
                    if link.lost:
                        hb, assignment = self._rejoin(hb)
                    else:
                        assignment = link.wait(joined.job.heartbeat_s) or assignment
                    continue
                # The protocol discarded a gradient computed on an old model, the shard held a push that ran
                # ahead before its direction could be judged, or it switched protocol while the step was on its
                # way: no error, the next step pulls at once (under the protocol its next assignment names).
                self.m.discarded.labels(self.m.worker, code).inc()
                self.discarded += 1
                # the count is cumulative: a heartbeat built from `hb` (idle, waiting for a batch) must not report less
                hb = replace(hb, discarded=self.discarded)
                self.process.beat.last = replace(self.process.beat.last, discarded=self.discarded)
                if code == ErrorCode.SWITCHED:
                    # Every step until the scheduler names the new protocol would be refused too (a fast worker's
                    # dozens in a heartbeat interval, bench/RESULTS.md 59): ask now, and wait for the answer.
                    log.info("%s: a shard applies another protocol now; asking the scheduler which", joined.id)
                    self.process.beat.send(self.process.beat.last)
                    assignment = link.wait(joined.job.heartbeat_s) or assignment
                    continue
                self.process.beat.when_due()
            else:
                self.batches.step_succeeded()
                if result is not None:
                    self.skipped_in_a_row = 0
                    hb = self._record(
                        hb,
                        replace(result, times=replace(result.times, data_s=self.data_s)),
                        assignment.assignment_id,
                        steps.comm_s,
                    )
            if link.lost:
                hb, assignment = self._rejoin(hb)
            else:
                assignment = link.poll() or assignment
        log.info("%s stopping after %d steps, %d samples", joined.id, hb.steps, hb.samples)
        return 0

    def _switch(self, protocol: str, steps: StepLoop) -> StepLoop:
        """The scheduler switched the job to `protocol` (`--protocol auto`; every shard applies it already): leave
        the current loop at this step boundary and enter the new protocol's, which starts from a pull, or (a delta
        protocol) from the model the worker holds (StepLoop.start_from: on a shard-bound job every worker's pull
        after the switch would queue at the shard). A protocol this job cannot run keeps the current loop (logged):
        the scheduler's word is checked like any other."""
        joined = self.joined
        try:
            loop = LOOPS[protocol_spec(protocol).worker_loop]
            job = replace(joined.job, protocol=protocol)
            job.validate()
        except (ConfigError, ValueError) as exc:
            log.error(
                "%s: the scheduler named protocol %r (%s); keeping %s", joined.id, protocol, exc, joined.job.protocol
            )
            return steps
        held = steps.held()
        steps.close()
        previous, joined.job = joined.job.protocol, job
        joined.shards.protocol = protocol
        entered = loop(self.step_context())
        start = (
            f"from the model it holds (version {held.version}), no pull"
            if held is not None and entered.start_from(held)
            else "from a pull"
        )
        log.info(
            "%s: protocol %s from now on, was %s (the scheduler's --protocol auto); starting %s",
            joined.id,
            protocol,
            previous,
            start,
        )
        return entered

    def _roll_back(self, steps: StepLoop, number: int) -> WorkerHeartbeat:
        """The shards went back to their last good checkpoint (rollback `number`): the model this worker holds is
        the one thrown away, and the versions it waits for may never come again, so it pulls afresh.

        The steps it skipped so far are reported first, under the old number: they were skipped on the old
        model, and the scheduler does not hold them against the restored one.
        """
        beat = self.process.beat
        log.warning("%s: the job rolled back (rollback %d); pulling the model again", self.joined.id, number)
        self.process.link.heartbeat(beat.last)
        beat.rollbacks = number
        beat.last = replace(beat.last, rollbacks=number)
        steps.after_failure(ErrorCode.ROLLED_BACK)
        return beat.last

    def _await_batch(self, hb: WorkerHeartbeat) -> tuple[WorkerHeartbeat, WorkerAssignment | None]:
        """WorkerHeartbeat `hb` until the scheduler gives this worker a batch (or stops the job); returns the last
        heartbeat (a fresh one if it registered again meanwhile: the new member's counters start from 0) and the
        assignment. An idle worker's `hb` names the assignment it holds, which gave it no batch: the scheduler then
        knows no step of an earlier answer is still on its way, and gives what it did not train back to the job."""
        process = self.process
        while not process.stopping:
            if process.link.lost:
                return self._rejoin(hb)
            problem = never_admitted(process.link.refused, hb)
            if problem is not None:
                raise NeverAdmitted(f"{self.joined.id}: {problem}")
            assignment = process.link.ask(hb)
            if assignment is not None and (self._batch(assignment, hb) > 0 or assignment.stop):
                return hb, assignment
            process.health.tick()
        return hb, None

    def _batch(self, assignment: WorkerAssignment, hb: WorkerHeartbeat) -> int:
        """The batch of the next step: the assigned one, the last sized to what this worker's allotment leaves after
        the samples `hb` reports (common/allotment.py); 0: none, as for an assignment whose batch this worker cannot
        step with (below the floor, above its own --max-batch): it idles rather than fail a step on it."""
        problem = batch_problem(assignment.batch, self.opts.max_batch)
        if problem is not None:
            if assignment.assignment_id != self.refused_assignment:
                self.refused_assignment = assignment.assignment_id
                log.error(
                    "%s: assignment %d refused: %s; idle until another",
                    self.joined.id,
                    assignment.assignment_id,
                    problem,
                )
            return 0
        left = None if assignment.allotted is None else assignment.allotted - hb.samples
        return allotted_batch(
            assignment.batch, left, protocol_spec(self.joined.job.protocol).report_steps(assignment.local_steps)
        )

    def _record(self, prev: WorkerHeartbeat, result: StepResult, assignment_id: int, sync_s: float) -> WorkerHeartbeat:
        """Export a step's figures and report them to the scheduler; returns the heartbeat sent."""
        one_step, joined, process = result.times.per_step(result.steps), self.joined, self.process
        for phase in PHASES[1:]:  # the phases; the scheduler exports the whole step
            self.m.phase.labels(joined.id, phase).observe(getattr(one_step, f"{phase}_s"))
        samples = result.batch * result.steps
        self.m.steps.inc(result.steps)
        self.m.samples.inc(samples)
        self.m.batch.set(result.batch)
        self.m.loss.set(result.loss)
        process.health.ready = True
        process.health.tick()
        hb = heartbeat_after(
            prev,
            result,
            sync_s=sync_s,
            moved_bytes=joined.shards.moved_bytes,
            staleness=joined.shards.staleness,
            assignment_id=assignment_id,
            skipped=self.skipped,
            rollbacks=process.beat.rollbacks or 0,
            discarded=self.discarded,
        )
        process.beat.send(hb)
        return hb

    def _rejoin(self, hb: WorkerHeartbeat) -> tuple[WorkerHeartbeat, WorkerAssignment | None]:
        """The scheduler forgot this worker (it restarted, or dropped it): register again, then await a batch."""
        if not self.process.register_again(self.joined):
            return hb, None
        fresh = self.process.beat.last = WorkerHeartbeat(
            standalone_sps=hb.standalone_sps, standalone_fixed_s=hb.standalone_fixed_s
        )
        self.joined.shards.staleness = []  # the scheduler counts this worker anew, staleness as its steps
        self.skipped = 0  # and its skipped steps
        return self._await_batch(fresh)
