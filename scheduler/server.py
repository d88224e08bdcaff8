"""The scheduler's socket loop: one ROUTER, every decision in job_state.py.

It answers HELLO with WELCOME, HEARTBEAT with the member's ASSIGNMENT, takes
EVAL reports and BYE, and serves STATUS to `dynabatch run` and operators.
Bad input is answered with ERROR and counted; the loop never dies of it.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import astuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynabatch.common.atomic_file import out_of_descriptors
from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.net.curve import CurveKeys, KeyRole
from dynabatch.common.net.key_roles import HELLO_KEY_ROLE, check_key_role
from dynabatch.common.net.log_limit import RateLimitedLog
from dynabatch.common.net.metrics import ADDRESS_LOG, Health, MetricsServer, bad_messages_counter, connection_reports
from dynabatch.common.net.transport import Incoming, bind_router, open_context, recv_routed, send_error, send_routed
from dynabatch.common.planning.auto_choice import choice_of
from dynabatch.common.planning.prediction import POLICIES
from dynabatch.common.planning.protocol_switch import SWITCHABLE, switch_to
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.eval_bounds import MAX_EVAL_METRICS
from dynabatch.common.wire.frames import Message, ProtocolError, WireLimits
from dynabatch.common.wire.handlers import Handlers
from dynabatch.common.wire.messages import (
    Answer,
    Bye,
    ByeAck,
    DecisionLatency,
    EvalReport,
    Hello,
    Report,
    Role,
    ShardAssignment,
    ShardHeartbeat,
    StatusReply,
    StatusRequest,
    Welcome,
    WorkerAssignment,
    WorkerHeartbeat,
)
from dynabatch.common.wire.step_times import PHASES
from dynabatch.scheduler.hello_rate import HelloRate
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.options import SchedulerOptions
from dynabatch.scheduler.outage_clock import read_clock
from dynabatch.scheduler.progress_log import ProgressLog
from dynabatch.scheduler.saved_progress import load_progress, progress_path, save_progress

log = logging.getLogger("dynabatch.scheduler")
Reply = Welcome | WorkerAssignment | ShardAssignment | ByeAck | StatusReply | None
DECISION_TIMES_KEPT = 4096
# Nothing sent to the scheduler carries a tensor, and its largest message (an EVAL
# and its metrics) takes well under a kilobyte: a message with tensor frames or a
# larger envelope is refused before it is parsed, and never becomes a tensor here.
ENVELOPE_ONLY = WireLimits(max_chunks=0, max_frame_bytes=0, max_envelope_bytes=1 << 16, max_array=1024)
# A turn of the loop waits at most 0.1 s for messages; one that took this long means the process itself
# stalled, and heartbeats that queued meanwhile may not all have reached the socket yet.
STALL_S = 1.0
EXPORT_EVERY_S = 0.25  # between two copies of the state into the series (and the decision log): a scrape comes every
# 15 s, and a copy after every turn of the loop, hundreds a second while workers report each step, cost a short
# job's scheduler a third of its CPU
SAVE_EVERY_S = 1.0  # samples trained since the last save are not counted after a restart: the job trains them again


class SchedulerMetrics:
    """Job-level series; per-worker gauges carry a `worker` label (bounded by the job's size)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bad = bad_messages_counter(registry)
        self.live = Gauge("dynabatch_scheduler_live_workers", "Workers sending heartbeats.", registry=registry)
        self.batch = Gauge(
            "dynabatch_worker_batch_size", "Batch size assigned to each worker.", ["worker"], registry=registry
        )
        self.sps = Gauge(
            "dynabatch_worker_samples_per_second", "Each worker's last step throughput.", ["worker"], registry=registry
        )
        self.idle = Gauge(
            "dynabatch_worker_idle",
            "1 while the scheduler keeps a worker idle (Ringmaster would discard every step it took), else 0.",
            ["worker"],
            registry=registry,
        )
        self.wire = {  # the wire's schedule (scheduler/wire_schedule.py), in the order plan, credit, rank
            "group": Gauge(
                "dynabatch_worker_chunks_per_push",
                "Chunks each worker's pipelined backward batches into one push (the wire's schedule).",
                ["worker"],
                registry=registry,
            ),
            "credit": Gauge(
                "dynabatch_worker_credit_bytes",
                "Gradient bytes each worker may keep pushed and unacknowledged (the wire's schedule).",
                ["worker"],
                registry=registry,
            ),
            "rank": Gauge(
                "dynabatch_worker_serve_rank",
                "The order shards serve each worker in (0 first; -1: unranked, by chunk id alone).",
                ["worker"],
                registry=registry,
            ),
        }
        self.step = Gauge(
            "dynabatch_worker_step_seconds",
            "Each worker's last step time by phase.",
            ["worker", "phase"],
            registry=registry,
        )
        self.epoch = Gauge(
            "dynabatch_job_epoch", "Passes over the training set, counted from samples.", registry=registry
        )
        self.samples = Gauge("dynabatch_job_samples", "Training samples processed by all workers.", registry=registry)
        self.loss = Gauge("dynabatch_job_train_loss", "Smoothed training loss reported by workers.", registry=registry)
        self.test_acc = Gauge(
            "dynabatch_job_test_accuracy", "Test accuracy of the latest evaluated model (0-1).", registry=registry
        )
        self.test_loss = Gauge("dynabatch_job_test_loss", "Test loss of the latest evaluated model.", registry=registry)
        self.eval_metric = Gauge(
            "dynabatch_eval_metric",
            "Each metric of the latest evaluation (the loss included), by name.",
            ["name"],
            registry=registry,
        )
        self.local_steps = Gauge(
            "dynabatch_scheduler_local_steps", "Local steps H between syncs (local, msd).", registry=registry
        )
        self.lost_samples = Gauge(
            "dynabatch_job_lost_samples",
            "Samples whose updates shards lost in restarts, trained again.",
            registry=registry,
        )
        self.lost_versions = Gauge("dynabatch_job_lost_versions", "Shard updates lost in restarts.", registry=registry)
        self.bytes = Gauge("dynabatch_job_bytes", "Tensor bytes moved between workers and shards.", registry=registry)
        self.rollbacks = Counter(
            "dynabatch_rollbacks",
            "Rollbacks of the job to its shards' last good checkpoints after a divergence.",
            registry=registry,
        )
        self.lr_factor = Gauge(
            "dynabatch_job_lr_factor", "The job's step-size factor after its rollbacks (1: none).", registry=registry
        )
        self.reassign = Counter(
            "dynabatch_scheduler_reassignments", "Batch allocation changes, by reason.", ["reason"], registry=registry
        )
        self.auto_policy = Gauge(
            "dynabatch_scheduler_auto_batch_policy",
            "--batch-policy auto: 1 for the batch policy it runs now, 0 for the others (the reason is in STATUS).",
            ["policy"],
            registry=registry,
        )
        self.auto_protocol = Gauge(
            "dynabatch_scheduler_auto_protocol",
            "--protocol auto: 1 for the protocol the workers step under, 0 for the others (the choice, the "
            "shards' switch and the reason are in STATUS).",
            ["protocol"],
            registry=registry,
        )
        self.decide = Histogram(
            "dynabatch_scheduler_decision_seconds",
            "Time to handle a heartbeat (model fit and allocation included).",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=registry,
        )


class SchedulerServer:
    """Runs the control loop until the job has finished and its shards were told."""

    def __init__(
        self, job: JobConfig, opts: SchedulerOptions, metrics_host: str, metrics_port: int, curve: CurveKeys | None
    ) -> None:
        self.job = job
        self.opts = opts
        self.state = JobState(job, job.shards)
        self.progress_path = progress_path(opts.state_dir, job.job) if opts.state_dir else None
        saved = load_progress(self.progress_path, to_dict(job)) if self.progress_path is not None else None
        if saved is not None:
            self.state.resume(saved, time.monotonic(), read_clock())
            log.info(
                "resumed job %r from %s: epoch %.2f (%d samples), %s, next worker id w%d",
                job.job,
                self.progress_path,
                self.state.progress.epoch,
                saved.samples,
                f"evaluated at version {saved.eval.version}" if saved.eval else "no evaluation yet",
                saved.next_id.get(Role.WORKER, 0),
            )
        self._saved_eval = self.state.evaluations.eval
        self._saved_lost_versions = self.state.progress.lost_versions
        self._next_save = 0.0
        self._start_checked = saved is not None  # a fresh count is checked against the shards' first versions
        self.registry = CollectorRegistry()
        self.health = Health()
        self.health.ready = True
        self.metrics_server = MetricsServer(self.registry, self.health, metrics_host, metrics_port)
        self.m = SchedulerMetrics(self.registry)
        self.ctx = open_context(curve)
        self.sock, self.endpoint = bind_router(self.ctx, opts.bind, connection_reports(self.registry, "scheduler"))
        self.hello_rate = HelloRate(opts.hello_rate_per_s, opts.hello_burst or 2 * job.max_workers + job.shards)
        self.stopping = False
        self.refusals = RateLimitedLog(log)
        self._decisions_seen = 0
        self._auto_said = (0, "")
        self.decision_times: deque[float] = deque(maxlen=DECISION_TIMES_KEPT)
        self._exported: set[str] = set()
        self._eval_exported: EvalReport | None = None
        self._metric_names: set[str] = set()
        self._metric_names_full = False
        self._rollbacks_seen = 0
        self._failure_logged = False
        self.progress_log = ProgressLog(opts.log_every_s)
        self.stopped_by: signal.Signals | None = None
        self.handlers = Handlers[Incoming, Reply]("the scheduler")  # by message type, with where it came from
        self.handlers.on(Hello, self._on_hello)
        self.handlers.on(WorkerHeartbeat, lambda msg, incoming: self._decided(self.state.heartbeat, msg, incoming))
        self.handlers.on(ShardHeartbeat, lambda msg, incoming: self._decided(self.state.shard_heartbeat, msg, incoming))
        self.handlers.on(EvalReport, self._on_eval)
        self.handlers.on(Bye, self._on_bye)
        self.handlers.on(StatusRequest, self._on_status)

    def run(self) -> int:
        """Serve the job until it has finished (or a signal stops it); the end is logged, however it comes."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ADDRESS_LOG.info(
            "scheduler for job %r at %s, metrics %s", self.job.job, self.endpoint, self.metrics_server.url()
        )
        try:
            self._serve()
        except Exception as exc:
            log.critical(
                "the scheduler failed at epoch %.2f: %s: %s", self.state.progress.epoch, type(exc).__name__, exc
            )
            raise
        finally:
            self._export()
            self._save(time.monotonic(), force=True)
            self.metrics_server.close()
        if self.stopped_by is not None:
            finished = self.state.finished
            log.log(
                logging.INFO if finished else logging.WARNING,
                "stopped by %s at epoch %.2f, the job %s; %s",
                self.stopped_by.name,
                self.state.progress.epoch,
                "finished" if finished else "not finished",
                f"its progress is saved in {self.progress_path}"
                if self.progress_path
                else "its progress is not saved (no --state-dir): a scheduler started again counts from zero",
            )
        return 0

    def _serve(self) -> None:
        finished_at: float | None = None
        last_turn = next_export = time.monotonic()
        while not self.stopping:
            if self.sock.poll(100):
                for _ in range(256):
                    self._handle(recv_routed(self.sock, ENVELOPE_ONLY))
                    self._save(time.monotonic())
                    if not self.sock.poll(0):
                        break
            now = time.monotonic()
            if now - last_turn > STALL_S:
                log.warning(
                    "the scheduler's loop stalled for %.1f s; members' silence in that time is excused", now - last_turn
                )
                self.state.roster.excuse(now - last_turn)
            last_turn = now
            self.state.expire(now)
            self.state.tick(now)  # a final evaluation given up is logged with the job's end (`_log_finish`)
            if now >= next_export:
                self._export()
                next_export = now + EXPORT_EVERY_S
            self._save(now)
            self.health.tick()
            if self.state.finished:
                if finished_at is None:
                    finished_at = now
                    self._log_finish()
                shards_gone = not self.state.roster.shards
                if self.opts.exit_on_finish and (shards_gone or now - finished_at > self.job.liveness_timeout_s):
                    break

    def _log_finish(self) -> None:
        """The job's end: its epoch, its accuracy (the last real evaluation's), and a final evaluation given up."""
        s = self.state
        ev = s.evaluations.eval
        given_up = s.end.final_eval_given_up(s.finished, s.evaluations.final_eval)
        if given_up:
            log.warning(
                "final evaluation given up: %s; the accuracy is the last evaluation's (%s)",
                given_up,
                f"model v{ev.version}" if ev else "none was reported",
            )
        log.info("job finished: epoch %.2f, test accuracy %s", s.progress.epoch, ev.test_acc if ev else "n/a")

    def _save(self, now: float, force: bool = False) -> None:
        """Write the job's progress (--state-dir) every SAVE_EVERY_S, and before the next message is handled when it
        learned what no process can tell a restarted scheduler: a new evaluation, or work a shard lost. A loss
        left to the next save would die with a scheduler killed before it, and the restarted shard, training on
        through the outage, would pass the saved version unseen: that work would never be trained again. A save
        that finds no file descriptor is tried again at the next periodic one, news included."""
        news = (
            self.state.evaluations.eval is not self._saved_eval
            or self.state.progress.lost_versions != self._saved_lost_versions
        )
        if self.progress_path is None or not (force or now >= self._next_save or news):
            return
        try:
            save_progress(self.progress_path, self.state.saved(now, read_clock()))
        except OSError as exc:
            if not out_of_descriptors(exc):
                raise
            log.warning("progress not saved: %s; trying again in %.0f s", exc.strerror, SAVE_EVERY_S)
        self._saved_eval = self.state.evaluations.eval
        self._saved_lost_versions = self.state.progress.lost_versions
        self._next_save = now + SAVE_EVERY_S

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self.stopped_by = signal.Signals(signum)

    def _handle(self, incoming: Incoming) -> None:
        if incoming.error is not None:
            return self._reject(incoming, incoming.error)
        msg = incoming.decoded
        try:
            if msg.job != self.job.job:
                raise ProtocolError(ErrorCode.WRONG_JOB, f"this scheduler runs job {self.job.job!r}, not {msg.job!r}")
            if msg.chunks:
                raise ProtocolError(ErrorCode.BAD_CHUNK, f"{msg.type} to the scheduler carries no tensors")
            reply = self.handlers.handle(msg, incoming)
        except ProtocolError as exc:
            exc.ref = msg.seq
            return self._reject(incoming, exc)
        except Exception as exc:  # a bug must cost one message, never the scheduler
            log.exception("internal error handling %s from %s", msg.type, msg.sender)
            return self._reject(incoming, ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", msg.seq))
        if reply is not None:
            send_routed(self.sock, incoming.identity, reply, msg.seq, self.job.job, "scheduler")

    def _on_hello(self, msg: Message[Hello], incoming: Incoming) -> Welcome:
        body, now = msg.body, time.monotonic()
        if body.role in HELLO_KEY_ROLE:
            check_key_role(incoming.key_role, (HELLO_KEY_ROLE[body.role],), f"HELLO as {body.role}")
        welcome = self.state.hello(body, now, incoming.identity, lambda: self.hello_rate.spend(incoming.peer, now))
        log.info("%s joined as %s (%s, %s)", body.name or body.host, welcome.id, body.role, body.host)
        return welcome

    def _decided(
        self, decide: Callable[[str, Report, float, bytes], Answer], msg: Message[Report], incoming: Incoming
    ) -> Answer:
        """A heartbeat's answer from `decide` (JobState.heartbeat or shard_heartbeat), its time measured."""
        start = time.perf_counter()
        answer = decide(msg.sender, msg.body, time.monotonic(), incoming.identity)
        took = time.perf_counter() - start
        self.m.decide.observe(took)
        self.decision_times.append(took)
        return answer

    def _on_eval(self, msg: Message[EvalReport], incoming: Incoming) -> None:
        check_key_role(incoming.key_role, (KeyRole.EVALUATOR,), "EVAL")
        self.state.eval_report(msg.sender, msg.body, time.monotonic(), incoming.identity)

    def _on_bye(self, msg: Message[Bye], incoming: Incoming) -> ByeAck:
        if self.state.bye(msg.sender, time.monotonic(), incoming.identity):
            log.info("%s left", msg.sender)
        return ByeAck()

    def _on_status(self, _msg: Message[StatusRequest], _incoming: Incoming) -> StatusReply:
        status = self.state.status(time.monotonic())
        status.decision_s = self._decision_latency()
        return StatusReply(state=status)

    def _decision_latency(self) -> DecisionLatency:
        """Mean and p99 seconds to handle a heartbeat, over the last DECISION_TIMES_KEPT of them.

        STATUS carries them so a benchmark reads exact figures rather than
        interpolating the Prometheus histogram's buckets.
        """
        times = sorted(self.decision_times)
        if not times:
            return DecisionLatency()
        return DecisionLatency(len(times), sum(times) / len(times), times[min(len(times) - 1, int(0.99 * len(times)))])

    def _reject(self, incoming: Incoming, error: ProtocolError) -> None:
        self.m.bad.labels("scheduler", error.code).inc()
        if error.code not in (ErrorCode.NOT_READY, ErrorCode.UNKNOWN_SENDER):
            self.refusals.refused(error.code, str(error))
        send_error(self.sock, incoming, error, self.job.job, "scheduler")

    def _export(self) -> None:
        """Copy the state into the Prometheus series and log new decisions."""
        s = self.state
        workers = s.roster.live_workers
        self.m.live.set(len(workers))
        self.m.epoch.set(s.progress.epoch)
        self.m.samples.set(s.progress.samples)
        self.m.bytes.set(s.progress.bytes)
        self.m.lost_samples.set(s.progress.lost_samples)
        self.m.lost_versions.set(s.progress.lost_versions)
        for lost in s.progress.losses:
            log.warning(
                "ps%d came back %d versions behind its last report (restarted, or rolled back, to a "
                "checkpoint): "
                "%d samples lost, counted back into the job",
                lost.shard,
                lost.versions,
                lost.samples,
            )
        s.progress.losses.clear()
        self.m.local_steps.set(s.allocator.local_steps)
        self._check_fresh_start()
        self._export_divergence()
        if s.progress.loss == s.progress.loss:
            self.m.loss.set(s.progress.loss)
        if s.evaluations.eval is not None:
            self.m.test_acc.set(s.evaluations.eval.test_acc)
            self.m.test_loss.set(s.evaluations.eval.test_loss)
        if s.evaluations.eval is not self._eval_exported and s.evaluations.eval is not None:
            ev = s.evaluations.eval
            log.info(
                "evaluation of model v%d at epoch %.2f: %s%s",
                ev.version,
                s.progress.epoch,
                ", ".join(f"{name} {value:.4f}" for name, value in ev.metrics.items()),
                " (final)" if ev.final else "",
            )
            self._export_eval_metrics(ev)
        line = self.progress_log.line(
            time.monotonic(), s.progress.samples, s.progress.epoch, self.job.epochs, len(workers), s.progress.loss
        )
        if line:
            log.info("%s", line)
        for gone in self._exported - set(workers):
            for gauge in (self.m.batch, self.m.sps, self.m.idle):
                gauge.remove(gone)
            for gauge in self.m.wire.values():
                gauge.remove(gone)
            for phase in PHASES:
                self.m.step.remove(gone, phase)
        self._exported = set(workers)
        ranks = s.wire.ranks(workers)
        for wid in workers:
            m = s.roster.members[wid]
            hb = m.last
            idle = s.allocator.idled.reason(wid)
            self.m.batch.labels(wid).set(s.allocator.batch_of(wid))
            self.m.sps.labels(wid).set(m.samples_per_s(idle))
            self.m.idle.labels(wid).set(1.0 if idle else 0.0)
            plan = s.wire.plan_of(wid)
            for name, shown in zip(self.m.wire, (plan.group, plan.credit, ranks.get(wid, -1)), strict=True):
                self.m.wire[name].labels(wid).set(shown)
            for phase, value in zip(PHASES, astuple(hb.times), strict=True):
                self.m.step.labels(wid, phase).set(value)
        new = min(s.allocator.assignment_id - self._decisions_seen, len(s.allocator.decisions))
        for d in s.allocator.decisions[len(s.allocator.decisions) - new :]:
            self.m.reassign.labels(d.reason).inc()
            log.info("decision (%s%s): batches %s", d.reason, f" {d.subject}" if d.subject else "", d.batches)
        self._decisions_seen = s.allocator.assignment_id
        self._export_auto()

    def _export_auto(self) -> None:
        """`--batch-policy auto` (and `--protocol auto`): the policy it runs (the protocols) into its gauge, and each
        new choice with its reason to the log."""
        auto, switch = self.state.allocator.auto, self.state.protocol
        if switch is not None:
            for name in SWITCHABLE:
                self.m.auto_protocol.labels(name).set(float(switch_to(name, switch.workers) is None))
        if auto is None:
            return
        for policy in POLICIES:
            self.m.auto_policy.labels(policy).set(1.0 if policy == auto.policy else 0.0)
        said = (auto.choices, choice_of(auto.reason))
        if said != self._auto_said:  # every choice, a kept one too, but not new figures while it waits
            log.info("batch policy auto runs %s: %s", auto.policy, auto.reason)
            self._auto_said = said

    def _check_fresh_start(self) -> None:
        """Say how to resume when shards hold a trained model while this scheduler counts the job from zero.

        Shards resume from their checkpoints; the job's count of samples, epochs and its evaluation live in the
        scheduler's progress file only. Started without it, the scheduler trains the job's epochs again on top of
        the shards' model and refuses evaluations of versions its fresh count cannot explain.
        """
        s = self.state
        reported = [m.shard_last.version for m in s.roster.shards.values() if m.heartbeats]
        if self._start_checked or not reported:
            return
        self._start_checked = True
        if max(reported) > 0 and s.progress.samples == 0:
            where = (
                f"--state-dir {self.opts.state_dir} holds no progress of job {self.job.job!r}"
                if self.progress_path
                else "this scheduler was started without --state-dir"
            )
            log.warning(
                "the shards hold a model at version %d, so job %r was in progress, but %s: its epochs, "
                "samples and evaluation count from zero here. A scheduler started with --state-dir DIR saves "
                "the job's progress there and, started again with the same DIR, resumes it",
                max(reported),
                self.job.job,
                where,
            )

    def _export_divergence(self) -> None:
        """Count and log each new rollback, and the job's failure once."""
        s = self.state
        for rb in s.rollbacks.rollbacks[self._rollbacks_seen :]:
            self.m.rollbacks.inc()
            log.warning(
                "rollback %d: the job diverged at epoch %.2f (%s); every shard goes back to its last good "
                "checkpoint, step size x%g",
                rb.number,
                rb.epoch,
                rb.cause,
                rb.lr_factor,
            )
        self._rollbacks_seen = len(s.rollbacks.rollbacks)
        self.m.lr_factor.set(s.rollbacks.lr_factor)
        if s.end.failed and not self._failure_logged:
            log.error("the job failed: %s", s.end.failed)
            self._failure_logged = True

    def _export_eval_metrics(self, report: EvalReport) -> None:
        """`dynabatch_eval_metric{name}` holds the latest evaluation's metrics, and only those.

        One EVAL carries at most MAX_EVAL_METRICS names, but evaluators of one job
        could send different ones over time: the series admits the first
        MAX_EVAL_METRICS names it sees and drops later ones (warning once), so
        its cardinality stays bounded for the whole job.
        """
        for name in report.metrics:
            if name in self._metric_names:
                continue
            if len(self._metric_names) < MAX_EVAL_METRICS:
                self._metric_names.add(name)
            elif not self._metric_names_full:
                self._metric_names_full = True
                log.warning(
                    "dynabatch_eval_metric already holds %d metric names; %r and any further new name are not exported",
                    MAX_EVAL_METRICS,
                    name,
                )
        shown = self._eval_exported.metrics.keys() & self._metric_names if self._eval_exported else set()
        for name in shown - report.metrics.keys():
            self.m.eval_metric.remove(name)
        for name, value in report.metrics.items():
            if name in self._metric_names:
                self.m.eval_metric.labels(name).set(value)
        self._eval_exported = report
