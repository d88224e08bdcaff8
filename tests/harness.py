"""Real processes on 127.0.0.1 for the integration tests.

Each role is started by cluster/launcher.py, as `dynabatch run` starts it, with its
log in the test's tmp folder; `Cluster.client` talks to them over real sockets with
the real codec.
Waiting is always for a condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import torch
import zmq

from dynabatch.cluster.launcher import Child, Launcher, keys_per_role
from dynabatch.cluster.launcher import child_env as child_env  # the tests take it from here
from dynabatch.cluster.launcher import command_line as command_line  # the tests take it from here
from dynabatch.cluster.metric_text import metric_sum
from dynabatch.cluster.parent_death import die_with_parent
from dynabatch.cluster.ports import free_port as free_port  # the tests take it from here
from dynabatch.cluster.preloaded import SUPPORTED as PRELOADING
from dynabatch.common.config import job_from_dict
from dynabatch.common.flags import ENV_PREFIX
from dynabatch.common.net.curve import CurveKeys
from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import Connection, use_curve
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.tasks.builtin_tasks import builtin_init
from dynabatch.common.verified_files import read_verified
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.messages import (
    Hello,
    Init,
    JobStatus,
    Role,
    StatusReply,
    StatusRequest,
    Welcome,
    WorkerAssignment,
    WorkerHeartbeat,
)
from dynabatch.worker.ps_client import ShardClients
from hang_guard import hang_guard_s, scaled_s
from processes import below, table

PRELOADER_ENV = ENV_PREFIX + "PRELOADER"  # `dynabatch run --preloader`'s variable


@contextmanager
def shared_preloader() -> Iterator[str]:
    """One preloader (`dynabatch preload`) for every job this test process starts: its socket in
    DYNABATCH_PRELOADER, so that each `dynabatch run` it starts and each `Cluster` fork their shards and
    workers from it. Torch's import, 2 s of CPU, once per test process instead of once per job
    (a tenth of the suite's CPU, bench/RESULTS.md 54). A child of this process, so what it forks is counted by
    `--cpu-durations`, and ended with it; nothing where there is no preloading."""
    if not PRELOADING:
        yield ""
        return
    folder = Path(tempfile.mkdtemp(prefix="dynabatch-test-preloader-"))
    sock = folder / "preloader.sock"
    with open(folder / "preloader.log", "w") as log:
        proc = start_preload(sock, log)
    try:
        os.environ[PRELOADER_ENV] = str(sock)
        yield str(sock)
    finally:
        os.environ.pop(PRELOADER_ENV, None)
        proc.terminate()
        try:
            proc.wait(hang_guard_s(30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def start_preload(sock: Path, output: IO[str] | int) -> subprocess.Popen[str]:
    """`dynabatch preload SOCK`, its output to `output`, a child of this process that dies with it, once a launcher
    can connect at SOCK (a socket file a killed preloader left there answers nothing); one that exits first fails
    the test with what it printed (to a pipe or a file)."""
    proc = subprocess.Popen(
        command_line("preload", [str(sock)]),
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    try:
        wait_for("dynabatch preload to listen", lambda: preloader_answers(sock) or proc.poll() is not None, 60)
    finally:
        if not preloader_answers(sock):
            proc.kill()
    if proc.poll() is not None:
        printed = proc.communicate()[0] if isinstance(output, int) else Path(output.name).read_text()
        raise AssertionError(f"dynabatch preload exited {proc.returncode}: {printed}")
    return proc


def preloader_answers(sock: Path) -> bool:
    """Whether a preloader listens at `sock`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(sock))
        except OSError:
            return False
    return True


def alone_env() -> dict[str, str]:
    """`child_env()` for a `dynabatch run` that forks its roles from a preloader of its own, so that they are
    below it in the process tree, where a test that follows the run's processes looks for them."""
    env = child_env()
    env.pop(PRELOADER_ENV, None)
    return env


def mlp_job(epochs: float, *slowdowns: str, dataset: str = "synthetic") -> list[str]:
    """The flags most `run_job` tests start from: the MLP on `dataset` for `epochs`, with one worker per slowdown
    given (none given: `dynabatch run`'s own workers and slowdowns). The cheap task a test of the system's
    behaviour wants; the default job's CNN is test_run.py's test_the_main_job_learns_fashion_mnist's."""
    workers = ["--workers", str(len(slowdowns)), "--slowdowns", *slowdowns] if slowdowns else []
    return ["--dataset", dataset, "--model", "mlp", "--epochs", f"{epochs:g}", *workers]


def run_job(out: Path, name: str, *flags: str, timeout_s: float = 300, plots: bool = False) -> tuple[Path, str]:
    """`dynabatch run` to its end: (run folder, what it printed); a failure shows the run's output and the tail
    of every process's log.

    The run gets a deadline of its own, shorter than the test's, so that a job
    that hangs is stopped by `dynabatch run` and leaves its logs behind: `timeout_s`
    scaled by the load and ended by the test's own limit (`hang_guard`), less 30 s
    scaled likewise (at most half of it) for the run to stop in. It draws no plots
    unless asked: a second of CPU each, in about 25 tests that read none.
    """
    guard_s = hang_guard_s(timeout_s)
    run_deadline_s = max(1.0, guard_s - min(scaled_s(30), guard_s / 2))
    cmd = command_line(
        "run",
        [
            "--out",
            str(out),
            "--name",
            name,
            "--timeout-s",
            str(run_deadline_s),
            *([] if plots else ["--no-plots"]),
            *flags,
        ],
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=guard_s, env=child_env())
    run_dir = out / name
    if done.returncode != 0:
        raise AssertionError(f"dynabatch run exited {done.returncode}\n{done.stdout}{done.stderr}{log_tails(run_dir)}")
    return run_dir, done.stdout


def log_tails(run_dir: Path, lines: int = 25) -> str:
    """The last `lines` lines of every process's log in `run_dir`, each under its file's name: what a failed
    assertion on a run shows."""
    return "".join(
        f"\n--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for log in sorted((run_dir / "logs").glob("*.log"))
    )


def trained_its_epochs(run_dir: Path) -> dict[str, Any]:
    """Check that the finished run in `run_dir` trained the epochs it was asked for, past them by at most one push
    per worker (the largest batch the worker held, times the local steps a reported step covers), and reported its
    figures: throughput against the workers' speeds, and no worker marked as having left that had not left before
    the job began stopping. Returns its summary."""
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert summary["finished"] and not summary["failed"], summary
    largest: dict[str, int] = {}
    for snap in timeline:
        for wid, w in snap["workers"].items():
            largest[wid] = max(largest.get(wid, 0), w["batch"])
    push = protocol_spec(summary["protocol"]).report_steps(max(s["local_steps"] for s in timeline))
    bound = push * sum(largest.values())
    assert summary["epochs_trained"] >= summary["epochs_requested"], summary
    assert 0 <= summary["overshoot_samples"] <= bound, (summary["overshoot_samples"], bound)
    departed = {wid for snap in timeline if not snap["stopping"] for wid in snap["departed"]}
    left = {wid for wid, w in summary["workers"].items() if w["left_early"]}
    assert left <= departed, f"{sorted(left - departed)} marked as having left early, which they had not"
    assert summary["fraction_of_compute_speed"] > 0 and summary["fraction_of_standalone"] > 0, summary
    return summary


def checkpoint_state(path: Path) -> dict[str, Any]:
    """The state a shard checkpoint at `path` holds (its checksum checked), as the shard would resume it."""
    state: dict[str, Any] = torch.load(io.BytesIO(read_verified(path)), weights_only=True)["state"]
    return state


def wait_for(
    what: str, predicate: Callable[[], T | None | Literal[False]], timeout_s: float = 60.0, every_s: float = 0.1
) -> T:
    """Poll `predicate` until it returns something truthy; fail the test with `what` after `timeout_s`, a hang
    guard scaled by the load (`hang_guard`)."""
    guard_s = hang_guard_s(timeout_s)
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {guard_s:.0f}s waiting for {what}")


Proc = Child  # a started process, as the tests call it
T = TypeVar("T")


def status_at(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> JobStatus | None:
    """The scheduler's STATUS at `endpoint`, or None if it does not answer within 2 s."""
    conn = Connection(ctx, endpoint, "dynabatch", "test")
    try:
        reply = conn.request(StatusRequest(), timeout_s=2.0)
    except TimeoutError:
        return None
    finally:
        conn.close()
    return reply.body.state if isinstance(reply.body, StatusReply) else None


def interrupt(run: subprocess.Popen[str] | subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Ctrl-C a `dynabatch run` and wait for it; if it outlasts `timeout_s`, kill it with everything it started.

    `dynabatch run` starts its children in process groups of their own, so killing the
    parent alone would leave them running past the test: every process group of the
    run's tree is killed (the test's own group excepted, where only the tree's members die).
    """
    run.send_signal(signal.SIGINT)
    try:
        run.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(run.pid)
        run.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its descendants and every process group among them other than this process's own."""
    # listed before anything dies (orphans are re-parented to init), zombies too: their children are still below them
    tree = [pid, *below(pid, {p: st.ppid for p, st in table().items()})]
    own = os.getpgrp()
    groups = set()
    for p in tree:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for group in groups - {own}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text format (0 if absent)."""
    return metric_sum(text, name, **labels)


ROLES_PROTOCOL = ["--protocol", "asgd"]
"""The protocol of a `Cluster` job whose flags name none. Its tests are about how the roles meet (trust, membership,
faults, the wire) and were written under asgd; the default, `--protocol auto`, would switch the shards and then the
workers once every worker is measured, at a moment the test's timing decides. The default job is run_job's (`dynabatch
run` on its defaults: test_run.py)."""


@dataclass
class Cluster:
    """Processes of one job, started by the launcher `dynabatch run` uses; everything started is stopped at teardown.

    With `curve_dir` every process and the test's own clients use those CURVE keys
    (the clients on a context of their own, so other tests' clients stay plain);
    each process gets a folder of its own holding only the files its role reads,
    as the Kubernetes manifests mount them.
    """

    tmp: Path
    job_flags: list[str] = field(default_factory=list)
    curve_dir: str = ""

    def __post_init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        curve_dirs: dict[str, str] = {}
        if self.curve_dir:
            self.ctx = zmq.Context()
            use_curve(self.ctx, CurveKeys.load(self.curve_dir, "worker"))
            curve_dirs = keys_per_role(self.curve_dir, self.tmp)
        self.launcher = Launcher(self.tmp, curve_dirs, preloader_socket=os.environ.get(PRELOADER_ENV, ""))

    @property
    def scheduler_endpoint(self) -> str:
        """The launcher's: it moves if the scheduler's port was taken before it could bind."""
        return self.launcher.scheduler_endpoint

    @property
    def procs(self) -> list[Proc]:
        """Every process started, in order."""
        return self.launcher.children

    def scheduler(self, *extra: str) -> Proc:
        flags = [*self.job_flags, *extra]
        return self.launcher.start_scheduler([*([] if "--protocol" in flags else ROLES_PROTOCOL), *flags])

    def shard(self, index: int = 0, port: int | None = None, *extra: str) -> Proc:
        return self.launcher.start_shard(index, f"ps{index}-{len(self.procs)}", extra, port)

    def worker(self, name: str, *extra: str) -> Proc:
        rest = [flag for flag in extra if flag != "--evaluator"]
        return self.launcher.start_worker(name, rest, evaluator=len(rest) < len(extra))

    def client(self, endpoint: str | None = None, sender: str = "test", job: str = "dynabatch") -> Connection:
        return Connection(self.ctx, endpoint or self.scheduler_endpoint, job, sender)

    def status(self) -> JobStatus | None:
        return status_at(self.ctx, self.scheduler_endpoint)

    def wait_status(self, what: str, predicate: Callable[[JobStatus], object], timeout_s: float = 60.0) -> JobStatus:
        """Poll STATUS until `predicate`; a timeout names every process that exited with an error, with its
        log's tail (a test may kill one on purpose, so an exit alone does not end the wait)."""

        def check() -> JobStatus | None:
            st = self.status()
            return st if st is not None and predicate(st) else None

        try:
            return wait_for(what, check, timeout_s, every_s=0.2)
        except AssertionError as exc:
            dead = "".join(
                f"\n--- {c.name} exited with {c.proc.returncode}; its log ends:\n{c.log_tail(25)}"
                for c in self.launcher.failed()
            )
            raise AssertionError(f"{exc}{dead}") from None

    def join_as_worker(
        self,
        standalone_sps: float = 1000.0,
        model: tuple[Init, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[Connection, Welcome]:
        """Register a test client as a worker, as the worker does, offer the shards a model (INIT: the first
        initialises them), and heartbeat until it holds a batch. The model is the job's built-in one unless
        `model` gives (INIT, initial flat parameters, initial travelling buffers)."""
        link = SchedulerLink(
            self.ctx, self.scheduler_endpoint, "dynabatch", "test-worker", WorkerHeartbeat, WorkerAssignment
        )
        deadline = time.monotonic() + 30
        welcome = link.register(
            Hello(role=Role.WORKER, name="test-worker"), lambda: time.monotonic() > deadline, lambda: None
        )
        assert welcome is not None, "timed out after 30s waiting for the scheduler to welcome a worker"
        conn = link.conn

        def heartbeat() -> None:
            link.heartbeat(WorkerHeartbeat())

        heartbeat()  # alive from the WELCOME on, as a worker's pulse keeps it: a silent member is a ghost
        job = job_from_dict(welcome.config)
        init, flat, buffers = model or (*builtin_init(job), None)
        shards = ShardClients(
            self.ctx,
            welcome.shards,
            make_layout(flat.numel(), job.chunk_bytes, job.shards),
            job.job,
            welcome.id,
            heartbeat,
            job.heartbeat_s,
            buffer_total=0 if buffers is None else buffers.numel(),
        )
        try:
            shards.init(init, flat, 30.0, buffers)
        finally:
            shards.close()

        def has_batch() -> bool:
            batch: int = conn.request(WorkerHeartbeat(standalone_sps=standalone_sps), timeout_s=2.0).body.batch
            return batch > 0

        wait_for("a batch for the test worker", has_batch, 30)
        return conn, welcome

    def stop(self) -> None:
        self.launcher.stop_all()


def finish_job(
    tmp: Path, job_flags: list[str], tasks: Sequence[str], evaluator_task: str, timeout_s: float = 300
) -> tuple[JobStatus, str, Proc]:
    """A job of one shard, a worker per task of `tasks` (PATH:NAME, the workers named a, b, c...) and an evaluator
    on `evaluator_task`, run to its end: (its last status, the shard's /metrics then, the shard's process, whose log
    stays readable). How the Byzantine tests set liars among honest workers: each runs a task of its own."""
    c = Cluster(tmp, job_flags)
    try:
        c.scheduler()
        shard = c.shard(0, None, "--on-finish", "idle")
        for i, task in enumerate(tasks):
            c.worker(chr(ord("a") + i), "--task", task)
        c.worker("eval", "--evaluator", "--task", evaluator_task)
        status = c.wait_status("the job to finish", lambda s: s.finished, timeout_s)
        return status, shard.metrics(), shard
    finally:
        c.stop()
