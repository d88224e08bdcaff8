"""The training worker: pull, forward/backward, push, heartbeat, repeat.

A step is timed from the start of the pull to the last push acknowledgement;
that is the time the scheduler equalizes across workers. The worker measures
its standalone speed before it joins, so the scheduler can size its first
batch from it rather than from a guess.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import replace
from typing import Any, Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynabatch.common.builtin_tasks import builtin_task
from dynabatch.common.chunking import TravellingBuffers, flat_params, make_layout, travelling
from dynabatch.common.config import JobConfig, check_flags_against_task, job_from_dict
from dynabatch.common.curve import CurveKeys
from dynabatch.common.error_codes import ErrorCode
from dynabatch.common.messages import Assignment, Heartbeat, Hello, Init
from dynabatch.common.metrics import Health, MetricsServer
from dynabatch.schedule import schedule_fields
from dynabatch.common.model_signature import signature_fields
from dynabatch.common.task_check import build_data, check_task, load_task
from dynabatch.task import Task
from dynabatch.task_error import TaskError
from dynabatch.common.flags import ConfigError
from dynabatch.common.protocols import GRADIENT, protocol_spec
from dynabatch.common.scheduler_link import SchedulerLink
from dynabatch.common.transport import RemoteError, open_context
from dynabatch.common.weights import load_weights, read_state_dict
from dynabatch.common.slowdown import Slowdown
from dynabatch.worker.batch_source import DatasetBatches, to_device, worker_order
from dynabatch.worker.heartbeats import heartbeat_after
from dynabatch.worker.loader_batches import LoaderBatches
from dynabatch.worker.loops import LOOPS
from dynabatch.worker.micro_batches import micro_batches
from dynabatch.worker.options import WorkerOptions
from dynabatch.worker.probe import probe_batch, standalone_speed
from dynabatch.worker.ps_client import ShardClients
from dynabatch.worker.pulse import Pulse
from dynabatch.worker.step_context import StepContext, StepLoop
from dynabatch.worker.step_times import StepResult

log = logging.getLogger("dynabatch.worker")
PHASES = ("pull", "compute", "push", "wait", "data")
SKIP_LOG_EVERY = 100  # a run of skipped steps is logged at its first step and every this many after
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker: str) -> None:
        self.phase = Histogram("dynabatch_worker_phase_seconds", "Time per step phase.", ["worker", "phase"],
                               buckets=STEP_BUCKETS, registry=registry)
        self.steps = Counter("dynabatch_worker_steps", "Training steps completed.", ["worker"], registry=registry).labels(worker)
        self.samples = Counter("dynabatch_worker_samples", "Training samples processed.", ["worker"], registry=registry).labels(worker)
        self.batch = Gauge("dynabatch_worker_current_batch_size", "Batch size in use.", ["worker"], registry=registry).labels(worker)
        self.loss = Gauge("dynabatch_worker_train_loss", "Training loss of the last step.", ["worker"], registry=registry).labels(worker)
        self.standalone = Gauge("dynabatch_worker_standalone_samples_per_second",
                                "Speed measured alone before joining (slowdown included).", ["worker"], registry=registry).labels(worker)
        self.errors = Counter("dynabatch_worker_request_errors", "Shard requests that failed and were retried.",
                              ["worker", "code"], registry=registry)
        self.errors.labels(worker, "timeout")  # exported at 0 from the start: a dashboard shows 0, not "No data"
        self.skipped = Counter("dynabatch_worker_skipped_steps", "Steps whose gradient was not pushed, by reason.",
                               ["worker", "reason"], registry=registry)
        self.skipped.labels(worker, "non_finite_loss")
        self.discarded = Counter("dynabatch_worker_discarded_steps", "Steps whose gradient the shards discarded as "
                                 "computed on too old a model (ringmaster, rennala).", ["worker"],
                                 registry=registry).labels(worker)
        self.worker = worker


def train_step(model: torch.nn.Module, batch: Any, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
               clip_grad_norm: float | None = None, micro_batch: int = 0) -> float:
    """Forward and backward over `batch`; leaves the (clipped) gradients on the parameters, returns the loss.

    With `micro_batch` M > 0 a larger batch runs as passes of at most M samples
    whose gradients accumulate, each pass's loss weighted by its share of the
    batch (micro_batches.py): the gradient and the returned loss are the whole
    batch's mean, and clipping applies to the accumulated gradient.
    """
    model.zero_grad(set_to_none=False)
    total = None
    for part, share in micro_batches(batch, micro_batch):
        loss = loss_fn(model, part)
        (loss if share == 1.0 else loss * share).backward()
        total = loss.detach() * share if total is None else total + loss.detach() * share
    if clip_grad_norm:
        torch.nn.utils.clip_grad_norm_(travelling(model), clip_grad_norm)
    return float(total)


def task_for(opts: WorkerOptions, job: JobConfig) -> Task:
    """The task this worker trains: `--task`, or the job's built-in model on its dataset; ConfigError if the
    job's flags conflict with it (`check_flags_against_task`: a hand-started scheduler's flags meet the task here)."""
    task = load_task(opts.task) if opts.task else builtin_task(job.dataset, job.model, opts.data_dir or None)
    check_flags_against_task(job, task.optimizer)
    return task


class Worker:
    """A training worker (or, with --evaluator, see evaluator.py)."""

    def __init__(self, opts: WorkerOptions, metrics_host: str, metrics_port: int, curve: CurveKeys | None) -> None:
        self.opts = opts
        self.name = opts.name or f"{socket.gethostname()}-{os.getpid()}"
        self.ctx = open_context(curve)
        self.device = torch.device(opts.device)
        self.registry = CollectorRegistry()
        self.health = Health()
        self.metrics_server = MetricsServer(self.registry, self.health, metrics_host, metrics_port)
        log.info("metrics on %s", self.metrics_server.url())
        self.link = SchedulerLink(self.ctx, opts.scheduler, opts.job, self.name)
        self.slowdown = Slowdown.parse(opts.slowdown)
        self.stopping = False
        self.pulse: Pulse | None = None
        self.started = time.monotonic()
        self.skipped = 0  # steps not pushed because their loss was not finite (HEARTBEAT.skipped)
        self.rollbacks: int | None = None  # the last rollback this worker acted on, once it trains (HEARTBEAT's)
        self.skipped_in_a_row = 0  # since the last step that was pushed: what the log says
        torch.set_num_threads(opts.threads)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def join(self, role: str) -> bool:
        """Register, then load data and model for the job the scheduler runs."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        welcome = self.link.register(self._hello(role), lambda: self.stopping, self.health.tick)
        if welcome is None:
            return False
        self.id = welcome.id
        self.job: JobConfig = job_from_dict(welcome.config)
        self.link.conn.job = self.job.job
        self.pulse = Pulse(self.link, self.job.heartbeat_s).start()  # loading data and the model can take long
        self.task = task_for(self.opts, self.job)
        sig, train_data, _ = check_task(self.task, self.job.seed)
        self.data = build_data(self.task.eval_data, "eval_data") if role == "evaluator" else train_data
        self.loss_fn, self.collate = self.task.loss_fn(), self.task.collate_fn()
        self.model = self.task.build_model(self.job.seed).to(self.device)
        if self.opts.init:
            load_weights(self.model, read_state_dict(self.opts.init), f"--init {self.opts.init}")
        self.layout = make_layout(sig.total, self.job.chunk_bytes, self.job.shards)
        self.train_size = sig.train_size
        self.buffers = TravellingBuffers(sig.buffer_names)
        self.last_hb = Heartbeat()
        self._next_beat = 0.0
        self.shards = ShardClients(self.ctx, welcome.shards, self.layout, self.job.job, self.id,
                                   self._heartbeat_while_waiting, self.job.heartbeat_s, sig.buffer_total)
        self.m = WorkerMetrics(self.registry, self.id)
        init = Init(**signature_fields(sig), optimizer=self.task.optimizer.to_wire() if self.task.optimizer else {},
                    schedule=schedule_fields(self.task.schedule))
        try:
            acks = self.shards.init(init, flat_params(self.model), self.opts.request_timeout_s,
                                    self.buffers.read(self.model))
        except RemoteError as exc:
            raise TaskError(f"the job's shards refused this worker's model: {exc.text}") from None
        # The device is read off the model's parameters, not the flag: the log says where the model really is.
        log.info("%s joined job %r as %s: %s, %d parameters, %d training samples, %d shard(s)%s, slowdown %s, "
                 "parameters on %s", self.name, self.job.job, self.id, self.task.name, sig.total, sig.train_size,
                 len(welcome.shards), " (initialised them)" if any(a.initialized for a in acks) else "",
                 self.opts.slowdown, next(self.model.parameters()).device)
        return True

    def _hello(self, role: str) -> Hello:
        return Hello(role=role, host=socket.gethostname(), metrics_url=self.metrics_server.url(), name=self.name,
                     max_batch=self.opts.max_batch if role == "worker" else 0)

    def register_again(self, role: str) -> bool:
        """The scheduler forgot this process (it restarted, or dropped it): register anew, under a new id.

        False if the process is stopping or the scheduler refuses it for good
        (`job_over`: the job finished meanwhile).
        """
        log.warning("%s: the scheduler does not know this %s any more; registering again", self.id, role)
        try:
            if self.link.register(self._hello(role), lambda: self.stopping, self.health.tick) is None:
                return False
        except RemoteError as exc:
            log.warning("%s cannot register again: %s", self.id, exc)
            return False
        self.id = self.link.id
        for conn in self.shards.conns:
            conn.sender = self.id
        return True

    def step_context(self) -> StepContext:
        """What this worker's protocol loop may use (see step_context.py)."""
        return StepContext(
            job=self.job, model=self.model, layout=self.layout, shards=self.shards,
            train_size=self.train_size, request_timeout_s=self.opts.request_timeout_s,
            next_batch=self.next_batch, timed_compute=self.timed_compute, loss_fn=self.loss_fn,
            idle_for_slowdown=self.idle_for_slowdown, heartbeat_when_due=self.heartbeat_when_due,
            skip_step=self.skip_step, buffers=self.buffers, pipelined=self._pipelined(),
        )

    def _pipelined(self) -> bool:
        """Whether this worker's gradient steps overlap pull, compute and push (JobConfig.pipelines)."""
        return (protocol_spec(self.job.protocol).push_kind == GRADIENT
                and self.job.pipelines(len(self.layout.chunks), self.opts.micro_batch,
                                       self.task.clip_grad_norm is not None))

    def _heartbeat_while_waiting(self) -> None:
        """Repeat the last heartbeat (its counters are cumulative, so nothing is counted twice).

        Raises RemoteError once the scheduler has dropped this worker, so that a
        wait for shards that refuse it ends now and the worker registers again;
        and once the job has rolled back while it trains, so that a wait for a
        version the shards threw away (a synchronous round's) ends now too.
        """
        assignment = self.link.heartbeat(self.last_hb)
        self._next_beat = time.monotonic() + self.job.heartbeat_s
        self.health.tick()
        if self.link.lost:
            raise RemoteError("unknown_sender", "the scheduler has dropped this worker")
        if self.rollbacks is not None and assignment is not None and assignment.rollbacks > self.rollbacks:
            raise RemoteError("rolled_back", f"the job rolled back (rollback {assignment.rollbacks}); the model "
                                             "this step waits for or computed on was thrown away")

    def heartbeat_when_due(self) -> None:
        """Between progress reports, hear early whether the scheduler dropped this worker (raises RemoteError).

        A local round of H steps, or an evaluation of 10k images, can last long;
        the pulse (pulse.py) keeps the worker alive meanwhile, and this ends a
        round that the shards would refuse anyway.
        """
        if time.monotonic() >= self._next_beat:
            self._heartbeat_while_waiting()

    def timed_compute(self, batch: Any) -> tuple[float, float]:
        """Run one training step as this node's emulated hardware would: (loss, seconds).

        A factor F adds (F-1) times the step's CPU time as idle time. CPU time,
        not wall time, measures the work: contention on a shared machine
        inflates wall time, and multiplying that by F would make a slow node
        pay for the contention F times while a fast node pays once. This way
        every node pays it once, and the slow node does F times the work.
        """
        wall, cpu = time.perf_counter(), time.thread_time()
        loss = train_step(self.model, batch, self.loss_fn, self.task.clip_grad_norm, self.opts.micro_batch)
        if self.device.type == "cuda":  # the loss is in; the backward kernels may not be
            torch.cuda.synchronize(self.device)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        wall += self.idle_for_slowdown(cpu)
        return loss, wall

    def skip_step(self, loss: float) -> None:
        """A step whose loss is `loss` (not finite) was not pushed: count it, and tell the scheduler with the
        next heartbeat that is due, which judges whether the model diverged (HEARTBEAT.skipped)."""
        self.skipped += 1
        self.m.skipped.labels(self.id, "non_finite_loss").inc()
        if self.skipped_in_a_row % SKIP_LOG_EVERY == 0:
            log.error("%s: loss is %s; not pushing this step's gradient (%d skipped in a row; the scheduler rolls "
                      "the job back if its model diverged)", self.id, loss, self.skipped_in_a_row + 1)
        self.skipped_in_a_row += 1
        self.last_hb = replace(self.last_hb, skipped=self.skipped, loss=loss)
        self.heartbeat_when_due()

    def idle_for_slowdown(self, cpu_s: float) -> float:
        """Idle (F-1) x `cpu_s` for this node's slowdown factor F now; returns the seconds idled.

        The main thread is as silent while it idles as slower hardware would keep
        it computing; the pulse (pulse.py) keeps the worker alive meanwhile.
        """
        factor = self.slowdown.factor(time.monotonic() - self.started)
        if factor <= 1.0:
            return 0.0
        idle = (factor - 1.0) * cpu_s
        time.sleep(idle)
        return idle

    def measure_standalone(self) -> float:
        """Samples/s of forward+backward alone (slowdown included): the median of timed steps.

        The median, because processes starting beside this one (imports, data loading)
        make single steps slow at random.
        """
        batch = probe_batch(self.job.max_batch, self.opts.max_batch)
        train_step(self.model, self.next_batch(batch), self.loss_fn, micro_batch=self.opts.micro_batch)
        return standalone_speed(batch, [self.timed_compute(self.next_batch(batch))[1]
                                        for _ in range(self.opts.probe_steps)])

    def run(self) -> int:
        try:
            if not self.join("worker"):
                return 0
            self._train()
        finally:
            self.leave()
        self.after_job()
        return 0

    def leave(self) -> None:
        """Stop the pulse (the socket is the main thread's again), then BYE."""
        if self.pulse is not None:
            self.pulse.stop()
        self.link.bye()

    def after_job(self) -> None:
        """With --on-finish idle, a job that ended (rather than a signal) leaves the process up."""
        if self.opts.on_finish == "idle" and not self.stopping:
            log.info("job finished; idling until stopped (--on-finish idle)")
            self.health.idle_until(lambda: self.stopping)
        self.metrics_server.close()

    def next_batch(self, batch: int) -> Any:
        """The next `batch` samples of this worker's own shuffled order of the training set, on its device.

        After a failed step the same samples are used again, so what a worker
        trains on does not depend on when a shard or the scheduler hiccuped.
        The time it takes is added to `data_s`, the step's `data` phase.
        """
        start = time.perf_counter()
        out = to_device(self.batches.take(batch), self.device)
        self.data_s += time.perf_counter() - start
        return out

    def _check_micro_batching(self) -> None:
        """The pipelined step cannot accumulate passes: its backward pushes each chunk as soon as it is final."""
        pipelined = self.job.pipeline == "on" and protocol_spec(self.job.protocol).push_kind == GRADIENT
        if self.opts.micro_batch and pipelined:
            raise ConfigError(f"--micro-batch {self.opts.micro_batch}: job {self.job.job!r} runs with --pipeline on, "
                              "whose backward pushes each chunk's gradient as soon as it is final, so it cannot "
                              "accumulate passes; run this worker without --micro-batch, or the job with --pipeline auto")

    def _train(self) -> int:
        self._check_micro_batching()
        order = worker_order(len(self.data), self.job.seed, self.id)
        if self.opts.loader_workers:
            self.batches = LoaderBatches(self.data, order, self.collate, self.opts.loader_workers, self.job.seed)
        else:
            self.batches = DatasetBatches(self.data, order, self.collate)
        self.data_s = 0.0
        log.info("%s: %s, batches %s, %s", self.id,
                 f"passes of at most {self.opts.micro_batch} samples" if self.opts.micro_batch else "one pass per batch",
                 f"loaded ahead by {self.opts.loader_workers} processes" if self.opts.loader_workers else "loaded in-process",
                 f"steps pipelined over {len(self.layout.chunks)} chunks" if self._pipelined() else "steps not pipelined")
        try:
            return self._train_steps()
        finally:
            self.batches.close()

    def _train_steps(self) -> int:
        standalone = self.measure_standalone()
        self.m.standalone.set(standalone)
        log.info("%s standalone speed %.0f samples/s", self.id, standalone)
        self.batches.step_succeeded()
        hb = self.last_hb = Heartbeat(standalone_sps=standalone)
        steps = LOOPS[protocol_spec(self.job.protocol).worker_loop](self.step_context())
        assignment = self._await_batch(hb)
        self.rollbacks = assignment.rollbacks if assignment is not None else 0
        self.started = time.monotonic()  # slowdown schedules count from the first batch, not from start-up
        while assignment is not None and not assignment.stop and not self.stopping and not steps.finished:
            if assignment.rollbacks > self.rollbacks:
                hb = self._roll_back(steps, assignment.rollbacks)
            if assignment.batch == 0:  # left out for now (its fixed cost alone exceeds a round): idle, no push
                assignment = self._await_batch(hb)
                continue
            self.data_s = 0.0
            counted = list(self.shards.staleness)
            try:
                result = steps.step(assignment)
            except (TimeoutError, RemoteError) as exc:
                code = exc.code if isinstance(exc, RemoteError) else ErrorCode.TIMEOUT
                # A failed step is not counted, so neither are the pushes that live shards took from it: the
                # scheduler refuses more updates than steps x shards (a shard that restarted fails steps for a while).
                self.shards.staleness = counted
                steps.after_failure(code)
                self.batches.step_failed()
                if code != ErrorCode.TOO_STALE:
                    self.m.errors.labels(self.id, code).inc()
                    log.warning("%s: step failed (%s); retrying", self.id, exc)
                    if self.link.lost:
                        hb, assignment = self._rejoin(hb)
                    else:
                        assignment = self.link.wait(self.job.heartbeat_s) or assignment
                    continue
                # The protocol discarded a gradient computed on an old model: no error, the next step pulls at once.
                self.m.discarded.inc()
            else:
                self.batches.step_succeeded()
                if result is not None:
                    self.skipped_in_a_row = 0
                    hb = self._record(hb, replace(result, times=replace(result.times, data=self.data_s)),
                                      assignment.assignment_id, steps.comm_s)
            if self.link.lost:
                hb, assignment = self._rejoin(hb)
            else:
                assignment = self.link.poll() or assignment
        log.info("%s stopping after %d steps, %d samples", self.id, hb.steps, hb.samples)
        return 0

    def _roll_back(self, steps: StepLoop, number: int) -> Heartbeat:
        """The shards went back to their last good checkpoint (rollback `number`): the model this worker holds is
        the one thrown away, and the versions it waits for may never come again, so it pulls afresh.

        The steps it skipped so far are reported first, under the old number: they were skipped on the old
        model, and the scheduler does not hold them against the restored one.
        """
        log.warning("%s: the job rolled back (rollback %d); pulling the model again", self.id, number)
        self.link.heartbeat(self.last_hb)
        self.rollbacks = number
        self.last_hb = replace(self.last_hb, rollbacks=number)
        steps.after_failure("rollback")
        return self.last_hb

    def _await_batch(self, hb: Heartbeat) -> Assignment | None:
        """Heartbeat until the scheduler gives this worker a batch (or stops the job)."""
        while not self.stopping:
            if self.link.lost:
                return self._rejoin(hb)[1]
            self.link.heartbeat(hb)
            assignment = self.link.wait(self.job.heartbeat_s)
            if assignment is not None and (assignment.batch > 0 or assignment.stop):
                return assignment
            self.health.tick()
        return None

    def _record(self, prev: Heartbeat, result: StepResult, assignment_id: int, sync_s: float) -> Heartbeat:
        times = result.times
        for phase in PHASES:
            self.m.phase.labels(self.id, phase).observe(getattr(times, phase) / result.steps)
        samples = result.batch * result.steps
        self.m.steps.inc(result.steps)
        self.m.samples.inc(samples)
        self.m.batch.set(result.batch)
        self.m.loss.set(result.loss)
        self.health.ready = True
        self.health.tick()
        hb = heartbeat_after(prev, result, sync_s=sync_s, moved_bytes=self.shards.moved_bytes,
                             staleness=self.shards.staleness, assignment_id=assignment_id,
                             skipped=self.skipped, rollbacks=self.rollbacks or 0)
        self.link.heartbeat(hb)
        self.last_hb = hb
        self._next_beat = time.monotonic() + self.job.heartbeat_s
        return hb

    def _rejoin(self, hb: Heartbeat) -> tuple[Heartbeat, Assignment | None]:
        """The scheduler forgot this worker (it restarted, or dropped it): register again, then await a batch."""
        if not self.register_again("worker"):
            return hb, None
        fresh = self.last_hb = Heartbeat(standalone_sps=hb.standalone_sps)
        self.shards.staleness = []  # the scheduler counts this worker anew, staleness as its steps
        self.skipped = 0  # and its skipped steps
        return fresh, self._await_batch(fresh)
