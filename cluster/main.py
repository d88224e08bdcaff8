"""`dynabatch run`: a whole job on this machine, with live progress and a run folder.

Its defaults are the main job: Fashion-MNIST, the CNN, three workers slowed
down 1x, 2x and 4x, the protocol and the batch policy auto: the job starts on asgd with fixed
batches (B/n each), and the scheduler switches to what it predicts fastest on the workers it measures
(--protocol asgd keeps asgd; with --batch-policy dynamic that is DBS-SGD). With --curve-dir (keys
from `dynabatch keys`) every process, and this command's own link to the
scheduler, uses those keys; the run makes no keys itself.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dynabatch.cluster.launcher import Launcher, shared_keys
from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.cluster.options import RunOptions
from dynabatch.cluster.progress import format_progress, format_rollback
from dynabatch.cluster.report import Snapshot, plot, summarize, write_timeline
from dynabatch.cluster.restart_policy import CONFIG_ERROR_EXIT, after_exit
from dynabatch.cluster.worker_labels import emulated, label
from dynabatch.common.atomic_file import write_text_atomic
from dynabatch.common.cli_support import load_curve_keys, setup_logging
from dynabatch.common.config import JobConfig, check_flags_against_task
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.common.net.curve import CurveKeys, CurveOptions
from dynabatch.common.net.transport import Connection, RemoteError, open_context
from dynabatch.common.planning.auto_choice import choice_of
from dynabatch.common.planning.auto_protocol import resolved
from dynabatch.common.protocols import refuse_unread_settings
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.tasks.catalog import BUILTIN_METRICS
from dynabatch.common.tasks.dataset_files import BadDatasetFile, DatasetNotFound, check_dataset_files, find_dataset
from dynabatch.common.wire.messages import JobStatus, StatusReply, StatusRequest
from dynabatch.task_error import TaskError

log = logging.getLogger("dynabatch.run")


def parse(argv: Sequence[str]) -> tuple[RunOptions, JobConfig, CurveOptions, list[str]]:
    """Run options, the job, CURVE, and the job's flags to hand to the scheduler."""
    parser = FlagParser("dynabatch run", __doc__)
    add_flags(parser, RunOptions)
    add_flags(parser, JobConfig)
    add_flags(parser, CurveOptions)
    args = parser.parse_args(argv)
    opts, curve = from_args(RunOptions, args).anchored(), from_args(CurveOptions, args)
    try:
        job, chosen = resolved(settle(opts, from_args(JobConfig, args)))
    except ConfigError as exc:
        parser.error(str(exc))
    if chosen:
        print(f"dynabatch run: protocol auto chose {chosen}", flush=True)
    least = opts.workers * job.min_batch
    if job.global_batch < least:  # the scheduler's split then holds more than B: said in its decisions alone
        print(
            f"dynabatch run: note: --global-batch {job.global_batch} is below {opts.workers} workers x --min-batch "
            f"{job.min_batch}: a step of every worker takes at least {least} samples",
            file=sys.stderr,
            flush=True,
        )
    return opts, job, curve, job_flags(job)


def settle(opts: RunOptions, job: JobConfig) -> JobConfig:
    """The job as this command runs it, both validated; ConfigError naming a bad flag."""
    if job.min_workers == 1:
        job = replace(job, min_workers=opts.workers)  # every worker starts on the same model
    if opts.evaluator:
        job = replace(job, await_final_eval=True)  # a short job may end before the evaluator has joined
    opts.validate()
    job.validate()
    refuse_unread_settings(job)
    if opts.micro_batch and job.pipeline == "on":
        raise ConfigError("--micro-batch: the pipelined step (--pipeline on) cannot accumulate passes; drop one")
    if job.await_final_eval and not opts.evaluator:
        raise ConfigError(
            "--await-final-eval: this run starts no evaluator (--no-evaluator), so the job would wait "
            f"--join-timeout-s ({job.join_timeout_s:g} s) for one at its end; drop one of the two"
        )
    if job.min_workers > opts.workers:
        raise ConfigError(
            f"--min-workers {job.min_workers}: this run starts {opts.workers} worker(s) (--workers), so no batch "
            "would ever be handed out"
        )
    members = opts.workers + (1 if opts.evaluator else 0)
    if job.max_workers < members:
        raise ConfigError(
            f"--max-workers {job.max_workers}: this run starts {opts.workers} worker(s)"
            f"{' and an evaluator' if opts.evaluator else ''}, {members} members the scheduler would not all admit"
        )
    return job


def job_flags(job: JobConfig) -> list[str]:
    """The job's settings as the scheduler's command line."""
    flags: list[str] = []
    for key, value in asdict(job).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def check_inputs(opts: RunOptions, job: JobConfig) -> None:
    """What can be found wrong before anything starts; TaskError, ConfigError, DatasetNotFound or BadDatasetFile.

    A built-in job needs only its dataset's files (found, and their headers decoded): its models
    are ours and tested, and building one would import torch into a process that never trains
    (seconds of every run's start). A user's task, or weights to start from, are checked in full
    (model, training and evaluation data, loss and its gradient, metrics; the weights against the
    model), and so are the job's flags against it (`check_flags_against_task`, the rule every worker
    applies too). --target-metric must name a metric the evaluations will report.
    """
    if not opts.task and not opts.init:
        if job.dataset != "synthetic":
            check_dataset_files(job.dataset, find_dataset(job.dataset, opts.data_dir or None))
        check_target(opts, BUILTIN_METRICS)
        return
    # Imported here rather than at the top: they bring in torch.
    from dynabatch.common.tasks.builtin_tasks import builtin_task
    from dynabatch.common.tasks.task_check import check_task, load_task
    from dynabatch.common.tasks.weights import load_weights, read_state_dict

    task = load_task(opts.task) if opts.task else builtin_task(job.dataset, job.model, opts.data_dir or None)
    checked = check_task(task, job.seed)
    check_flags_against_task(job, task.optimizer)
    if opts.evaluator and task.eval_data is None:
        raise TaskError("the task has no eval_data for the evaluator: give it one, or pass --no-evaluator")
    check_target(opts, checked.metric_names)
    if opts.init:
        load_weights(task.build_model(job.seed), read_state_dict(opts.init), f"--init {opts.init}")


def check_target(opts: RunOptions, metric_names: Sequence[str]) -> None:
    """--target-metric names one of `metric_names` (what the evaluations report); TaskError if not."""
    target = opts.target()
    if target is not None and target.name not in metric_names:
        raise TaskError(
            f"--target-metric {target}: the evaluations report {', '.join(sorted(metric_names))}, not {target.name}"
        )


def prepare(opts: RunOptions, job: JobConfig) -> Path:
    """Check the job's inputs (`check_inputs`), then make the run folder with its config.json.

    TaskError, ConfigError or DatasetNotFound before anything is written; RunFolderError for a folder that holds a run
    or cannot be written, leaving no folder behind that this call made.
    """
    check_inputs(opts, job)
    name = opts.name or time.strftime("%Y%m%d-%H%M%S") + f"-{job.protocol}-{job.batch_policy}"
    run_dir = Path(opts.out) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        # Its shards would resume from the old checkpoints: a silent warm start, not a new run.
        raise RunFolderError(f"{run_dir} already holds a run; choose another --name or remove it")
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.json", json.dumps({"run": asdict(opts), "job": asdict(job)}, indent=2))
    except OSError as exc:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise RunFolderError(
            f"--out {opts.out}: cannot write the run folder {run_dir}: {exc.strerror or exc}"
        ) from None
    return run_dir


class RunFolderError(ValueError):
    """The run folder already holds a run, or cannot be made and written."""


def main(argv: Sequence[str]) -> int:
    setup_logging("INFO")
    opts, job, curve, flags = parse(argv)
    keys = load_curve_keys("dynabatch run", curve, "run")
    try:
        run_dir = prepare(opts, job)
    except (DatasetNotFound, BadDatasetFile, TaskError, ConfigError, RunFolderError) as exc:
        print(f"dynabatch run: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except KeyboardInterrupt:  # while checking the task: nothing started yet, no run folder made
        print("dynabatch run: interrupted before the job started", file=sys.stderr)
        return 128 + signal.SIGINT
    return JobRun(opts, job, flags, run_dir, curve.curve_dir, keys).execute()


class JobRun:
    """One `dynabatch run`: start, follow, stop, report."""

    def __init__(
        self,
        opts: RunOptions,
        job: JobConfig,
        job_flags: list[str],
        run_dir: Path,
        curve_dir: str,
        keys: CurveKeys | None,
    ) -> None:
        self.opts, self.job, self.job_flags, self.run_dir, self.keys = opts, job, job_flags, run_dir, keys
        self.launcher = Launcher(run_dir / "logs", shared_keys(curve_dir), preloader_socket=self.opts.preloader)
        self.timeline: list[Snapshot] = []
        self.interrupted = 0  # the signal that asked the run to stop (0: none)
        self.forced = False  # a second signal: every child killed, not waited for
        self.refused = ""  # a child's one-line reason for exiting CONFIG_ERROR_EXIT, which ended the run
        self.failure = ""  # why this command ended the run (a timeout, a child past --restarts), for the summary
        self.left_out: set[str] = set()  # workers past --restarts that the job goes on without
        self.targets_path = run_dir / "prometheus_targets.json"
        self.show_slowdown = emulated(Slowdown.parse(text).label() for text in opts.slowdowns)

    def _on_interrupt(self, signum: int, _frame: object) -> None:
        """The first SIGINT or SIGTERM stops the job in order; a second kills every child at once. Either
        way the run goes on to stop, wait for and report: nothing is raised into the code it interrupts."""
        if not self.interrupted:
            self.interrupted = signum
            print("\nstopping (Ctrl-C again to force)...", file=sys.stderr, flush=True)
        elif not self.forced:
            self.forced = True
            print("forced: killing every process of the run", file=sys.stderr, flush=True)
            self.launcher.kill_all()

    def execute(self) -> int:
        """Run the job to its end; 0 if it finished, 128 + the signal's number if interrupted, else 1.
        Ctrl-C or SIGTERM stops it cleanly (main thread only: `db.run` may be called from another), and
        the caller's signal handlers are back afterwards."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._execute()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _execute(self) -> int:
        started = time.monotonic()
        print(
            f"dynabatch run: {self.opts.workers} workers (slowdowns {' '.join(self.opts.slowdowns)}), "
            f"{self.job.shards} shard(s), "
            f"{self.opts.task or f'{self.job.model} on {self.job.dataset}'}, "
            f"{self.job.protocol} + {self.job.batch_policy} batches, "
            f"{self.job.epochs:g} epochs\nrun folder: {self.run_dir}"
        )
        ok = False
        try:
            self._start()
            ok = self._follow(started)
        finally:
            # Each step runs whatever the one before raised (a full disk): the children are always stopped,
            # and the summary always reaches the console.
            with ExitStack() as last:
                last.callback(lambda: self._report(time.monotonic() - started))
                last.callback(self.launcher.stop_all)
                self.launcher.write_targets(self.job.job, self.targets_path)
        if self.interrupted:
            return 128 + self.interrupted
        if self.refused:
            return CONFIG_ERROR_EXIT
        return 0 if ok else 1

    def _start(self) -> None:
        ln = self.launcher
        job = self.job.job
        ln.start_scheduler([*self.job_flags, "--state-dir", str(self.run_dir / "state")])
        for i in range(self.job.shards):
            ln.start_shard(
                i,
                f"ps{i}",
                [
                    "--job",
                    job,
                    "--checkpoint-dir",
                    str(self.run_dir / "checkpoints"),
                    "--checkpoint-interval-s",
                    str(self.opts.checkpoint_interval_s),
                    "--name",
                    f"ps{i}",
                ],
            )
        worker_flags = ["--job", job, "--threads", str(self.opts.threads)]
        trainer_flags = ["--micro-batch", str(self.opts.micro_batch), "--loader-workers", str(self.opts.loader_workers)]
        worker_flags += ["--data-dir", self.opts.data_dir] if self.opts.data_dir else []
        worker_flags += ["--task", self.opts.task] if self.opts.task else []
        worker_flags += ["--init", self.opts.init] if self.opts.init else []
        for i in range(self.opts.workers):
            ln.start_worker(
                f"worker{i}",
                [
                    *worker_flags,
                    *trainer_flags,
                    "--slowdown",
                    self.opts.slowdown_of(i),
                    "--max-batch",
                    str(self.opts.max_batch_of(i)),
                ],
            )
        if self.opts.evaluator:
            ln.start_worker("evaluator", [*worker_flags, "--slowdown", "1"], evaluator=True)
        ln.write_targets(job, self.targets_path)

    def _follow(self, started: float) -> bool:
        """Sample STATUS into the timeline and print progress until the job finishes."""
        conn = Connection(open_context(self.keys), self.launcher.scheduler_endpoint, self.job.job, "dynabatch-run")
        next_progress = 0.0
        rollbacks_shown = 0
        auto_shown = ""
        protocol_shown = ("", "")
        try:
            while not self.interrupted:
                if not self._supervise():
                    return False
                self.launcher.write_targets(self.job.job, self.targets_path)
                now = time.monotonic()
                if now - started > self.opts.timeout_s:
                    self.failure = f"timeout after {self.opts.timeout_s:.0f}s (--timeout-s)"
                    print(self.failure, file=sys.stderr)
                    return False
                status = self._sample(conn, started)
                if status is not None:
                    for rollback in status.rollbacks[rollbacks_shown:]:
                        if not (rollback.done or status.failed):
                            break  # said once every shard has restored, with the versions they restored
                        print(format_rollback(rollback), file=sys.stderr, flush=True)
                        rollbacks_shown += 1
                    if status.failed:
                        print(f"job failed: {status.failed}", file=sys.stderr, flush=True)
                        return False
                    if choice_of(status.auto_reason) != auto_shown:  # a new choice, not a kept one or new figures
                        print(f"batch policy auto runs {status.auto_policy}: {status.auto_reason}", flush=True)
                        auto_shown = choice_of(status.auto_reason)
                    if status.auto_protocol and (status.protocol, status.auto_protocol) != protocol_shown:
                        print(f"protocol auto runs {status.protocol}: {status.auto_protocol_reason}", flush=True)
                        protocol_shown = (status.protocol, status.auto_protocol)
                    if now >= next_progress or status.finished:
                        print(format_progress(status, now - started, self.show_slowdown), flush=True)
                        next_progress = now + self.opts.progress_s
                    if status.finished:
                        return True
                conn.recv(self.opts.status_s)
            self._sample(conn, started)  # interrupted: the job as it stands, its latest evaluation included
            return False
        finally:
            conn.close()

    def _sample(self, conn: Connection, started: float) -> JobStatus | None:
        """One STATUS into the timeline; None if the scheduler did not answer."""
        try:
            reply = conn.request(StatusRequest(), timeout_s=2.0)
        except (TimeoutError, RemoteError):
            return None
        if not isinstance(reply.body, StatusReply):
            return None
        self.timeline.append(Snapshot(reply.body.state, time.monotonic() - started))
        return reply.body.state

    def _supervise(self) -> bool:
        """Act on every child that exited with an error (`restart_policy.after_exit`), saying so on stderr;
        False, with the process's log tail printed, once the run cannot go on."""
        for c in self.launcher.failed():
            if c.name in self.left_out:
                continue
            returncode = c.proc.returncode
            assert returncode is not None  # failed() lists exited children
            action = after_exit(
                c.role,
                c.restarts,
                self.opts.restarts,
                self.launcher.movable(c),
                self._job_goes_on_without(),
                returncode,
                self.launcher.preloader_end(c),
            )
            code = f"{c.name} exited with code {returncode}"
            if action == "refused":
                self.refused = self.failure = f"{code}, not restarted: {c.reason()}"
                print(self.refused, file=sys.stderr, flush=True)
                return False
            if action == "rebind":
                print(
                    f"{code}: {c.endpoint} was taken before it could bind; starting it on another port",
                    file=sys.stderr,
                    flush=True,
                )
                self.launcher.rebind(c)
            elif action == "again":
                print(
                    f"{c.name} ended with the preloading process it was forked from (its end "
                    f"{self.launcher.preloader_end(c)} of {self.opts.restarts} allowed, --restarts); starting it "
                    "again, not one of its own restarts",
                    file=sys.stderr,
                    flush=True,
                )
                self.launcher.again(c)
            elif action == "restart":
                print(
                    f"{code}; starting it again ({c.restarts + 1} of {self.opts.restarts})", file=sys.stderr, flush=True
                )
                self.launcher.restart(c)
            else:
                spent = f"{code} after {c.restarts} restart(s) (--restarts {self.opts.restarts})"
                verdict = "the job goes on without it" if action == "leave_out" else "the run fails"
                print(f"{spent}; {verdict}; its log ends:\n{c.log_tail()}", file=sys.stderr, flush=True)
                if action == "fail":
                    self.failure = f"{spent}; {verdict}"
                    return False
                self.left_out.add(c.name)
        return True

    def _job_goes_on_without(self) -> bool:
        """Other workers run, and either the job trains or they are enough to start it (--min-workers)."""
        others = len(self.launcher.running("worker"))  # the worker that exited is not among them
        trained = bool(self.timeline) and self.timeline[-1].status.samples > 0
        return others > 0 and (trained or others >= self.job.min_workers)

    def _report(self, wall_s: float) -> None:
        """The summary on the console, then summary.json, the timeline and the plots in the run folder
        (the console first: on a full disk it is the only place the figures reach)."""
        statuses = [snap.status for snap in self.timeline]
        summary = summarize(statuses, wall_s, self.opts.warmup_fraction, self.opts.target())
        summary["interrupted"] = bool(self.interrupted)
        summary["failed"] = summary.get("failed") or self.failure or None  # the job's own reason first
        summary["finished"] = bool(summary.get("finished")) and not summary["failed"]  # a failed job ended, unfinished
        print(format_summary(summary, self.run_dir), flush=True)
        write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        write_timeline(self.run_dir, self.timeline)
        if statuses and self.opts.plots:
            plot(self.run_dir, statuses)


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    """The end-of-run lines: accuracy, speed, and each worker's share (by its name and slowdown, then the
    scheduler's id for it, in summary.json's order)."""
    failed = [f"FAILED: {summary['failed']}"] if summary.get("failed") else []
    if "error" in summary:
        return "\n".join([*failed, f"no result: {summary['error']} (logs in {run_dir / 'logs'})"])
    acc, metrics = summary["final_test_acc"], summary.get("final_metrics") or {}
    others = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "accuracy")
    figures = (
        f"test accuracy {100 * acc:.2f}%" + (f" ({others})" if others else "")
        if acc is not None
        else others or "no evaluation"
    )
    lines = [
        *failed,
        *(
            [f"rolled back {len(summary['rollbacks'])} time(s) after a divergence; step size x{summary['lr_factor']:g}"]
            if summary.get("rollbacks")
            else []
        ),
        _interrupted_line(summary, figures)
        if summary.get("interrupted")
        else f"finished={summary['finished']}  {figures}",
        *(
            [f"final evaluation {summary['final_evaluation']}; the accuracy is the last evaluation's"]
            if summary.get("final_evaluation")
            else []
        ),
        *_target_lines(summary),
        *(
            [f"batch policy auto ran {summary['auto_policy']} last: {summary['auto_reason']}"]
            if summary.get("auto_policy")
            else []
        ),
        *(
            [f"protocol auto ran {summary['protocol']} last: {summary['auto_protocol_reason']}"]
            if summary.get("auto_protocol")
            else []
        ),
        f"wall {summary['wall_s']:.1f}s, {summary['epochs']:.2f} epochs, {summary['samples_per_s']:.0f} samples/s "
        f"({100 * (summary['fraction_of_compute_speed'] or 0):.0f}% of the workers' summed compute-only speed, "
        f"{100 * (summary['fraction_of_standalone'] or 0):.0f}% of their start-up probes)",
        *_epochs_lines(summary),
    ]
    show_slowdown = emulated(w["slowdown"] for w in summary["workers"].values())
    for wid, w in summary["workers"].items():
        step, data = w["mean_step_s_after_warmup"], w["mean_data_s_after_warmup"]
        name = label(w["name"], w["slowdown"], show_slowdown)
        lines.append(
            f"  {name:<16} id {wid:<4} batch {w['final_batch']:>4}"
            + (f"  step {1000 * step:7.1f} ms" if step else "  step       -   ")  # no step after warm-up (idle)
            + (f" (data {1000 * data:5.1f} ms)" if data is not None else " (data     -   )")
            + f"  compute-only {w['compute_samples_per_s'] or 0:7.0f} samples/s"
            f"  probed {w['standalone_samples_per_s']:7.0f} samples/s"
            + (f"  discarded {w['discarded']} steps" if w.get("discarded") else "")
        )
    if summary["step_time_spread"] is not None:
        lines.append(f"step-time spread after warm-up: {100 * summary['step_time_spread']:.1f}%")
    lines.append(f"run folder: {run_dir}")
    return "\n".join(lines)


def _epochs_lines(summary: dict[str, Any]) -> list[str]:
    """`trained 5.000 of the 5 epochs asked (8 samples past them)`: the job's budget against what it trained."""
    trained, past = summary.get("epochs_trained"), summary.get("overshoot_samples")
    if trained is None or past is None:
        return []
    beyond = f"{past} samples past them" if past >= 0 else f"{-past} samples short of them"
    return [f"trained {trained:.3f} of the {summary['epochs_requested']:g} epochs asked ({beyond})"]


def _interrupted_line(summary: dict[str, Any], figures: str) -> str:
    """`interrupted at model v280 (epoch 0.48); last evaluation, of model v240 at 31.0 s: test accuracy 84.10%`:
    the figures are the last evaluated model's, which is not the model the run stopped at."""
    at = f"interrupted at model v{summary.get('model_version', 0)} (epoch {summary['epochs']:.2f})"
    version, eval_t = summary.get("final_eval_version"), summary.get("final_eval_t")
    if version is None:
        return f"{at}; no evaluation yet"
    return f"{at}; last evaluation, of model v{version} at {eval_t:.1f} s: {figures}"


def _target_lines(summary: dict[str, Any]) -> list[str]:
    """`time to accuracy>=0.9: 41.2 s` or why it was not reached (no line without --target-metric)."""
    target, seconds = summary.get("target_metric"), summary.get("time_to_target_s")
    if not target:
        return []
    if seconds is not None:
        return [f"time to {target}: {seconds:.1f} s of training"]
    name, reported = MetricTarget.parse(target).name, summary.get("final_metrics") or {}
    if reported and name not in reported:
        return [f"{target} not reached: the evaluations report {', '.join(sorted(reported))}, not {name}"]
    return [f"{target} not reached"]
