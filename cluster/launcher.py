"""Start a whole job's processes on 127.0.0.1 and stop them in order.

Children run in their own sessions, so Ctrl-C reaches only `dynabatch run`,
which then stops workers first, then the evaluator, then shards (which
checkpoint on SIGTERM), then the scheduler: nothing is killed mid-write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dynabatch.common.ports import free_port

STOP_ORDER = ("worker", "evaluator", "ps", "scheduler")


@dataclass
class Child:
    role: str
    name: str
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path


@dataclass
class Launcher:
    """The job's child processes and their logs."""

    run_dir: Path
    job_flags: list[str]
    curve_dir: str = ""  # passed to every child: with keys, the whole job uses CURVE
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.scheduler_endpoint = f"tcp://127.0.0.1:{free_port()}"

    def start(self, command: str, name: str, flags: list[str], role: str = "") -> Child:
        """Start `dynabatch COMMAND` with FLAGS as ROLE (default: the command); output to logs/NAME.log."""
        port = free_port()
        cmd = [sys.executable, "-m", "dynabatch.cli.main", command, *flags,
               "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--curve-dir", self.curve_dir]
        log_path = self.run_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        child = Child(role or command, name, port, proc, log_path)
        self.children.append(child)
        return child

    def start_scheduler(self) -> Child:
        return self.start("scheduler", "scheduler",
                          ["--bind", self.scheduler_endpoint, "--no-exit-on-finish", *self.job_flags])

    def start_shard(self, index: int, checkpoint_dir: Path, interval_s: float, job: str) -> Child:
        return self.start("ps", f"ps{index}", [
            "--scheduler", self.scheduler_endpoint, "--job", job, "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--shard-index", str(index), "--checkpoint-dir", str(checkpoint_dir),
            "--checkpoint-interval-s", str(interval_s), "--name", f"ps{index}",
        ])

    def start_worker(self, name: str, slowdown: str, job: str, data_dir: str, threads: int,
                     evaluator: bool = False) -> Child:
        flags = ["--scheduler", self.scheduler_endpoint, "--job", job, "--slowdown", slowdown,
                 "--name", name, "--threads", str(threads)]
        if data_dir:
            flags += ["--data-dir", data_dir]
        if evaluator:
            flags.append("--evaluator")
        return self.start("worker", name, flags, "evaluator" if evaluator else "worker")

    def failed(self, role: str) -> list[Child]:
        """Children of `role` that exited with an error."""
        return [c for c in self.children if c.role == role and c.proc.poll() not in (None, 0)]

    def running(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.proc.poll() is None]

    def stop(self, role: str, timeout_s: float = 15.0) -> None:
        """SIGTERM every running child of `role`, wait, then SIGKILL what is left."""
        victims = self.running(role)
        for c in victims:
            c.proc.send_signal(signal.SIGTERM)
        for c in victims:
            try:
                c.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def stop_all(self) -> None:
        for role in STOP_ORDER:
            self.stop(role)

    def wait_role(self, role: str, timeout_s: float) -> bool:
        """Wait for every child of `role` to exit by itself; False if some did not."""
        for c in self.running(role):
            try:
                c.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
        return True

    def write_targets(self, job: str) -> Path:
        """A Prometheus file_sd list of every child's /metrics, labelled by role and name.

        `job` is the job's name, as in Kubernetes, where the monitors take Prometheus'
        `job` label from the dynabatch.io/job pod label: the dashboard selects by it.
        """
        targets = [{"targets": [f"127.0.0.1:{c.metrics_port}"], "labels": {"job": job, "role": c.role, "name": c.name}}
                   for c in self.children]
        path = self.run_dir / "prometheus_targets.json"
        path.write_text(json.dumps(targets, indent=2))
        return path

    def log_tail(self, child: Child, lines: int = 15) -> str:
        return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:])
