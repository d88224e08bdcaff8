"""A dynabatch job whose processes run on the hosts of a `tests.netns.Network`, each started with the
commands of the README's "A job across machines": the scheduler and the shards bound on 0.0.0.0, a
shard advertising its host's name, every client given the scheduler's host name, `/metrics` on
0.0.0.0 for a Prometheus on another host, and, with `curve_dir`, CURVE keys per role (each process
gets a folder holding only the files its role reads, as on separate machines).

Processes are started and stopped through the launcher `dynabatch run` uses (logs in `log_dir`,
workers stopped before shards before the scheduler); every port is the same on every host, as on
real machines, since each host has an address of its own; a second process on one host (the shard
beside the scheduler, as the README allows) serves /metrics on the next port.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from dynabatch.cluster.launcher import Child, Launcher, command_line, keys_per_role
from dynabatch.cluster.metric_text import metric_sum
from tests.netns import Host, Network

SCHEDULER_PORT = 5555
SHARD_PORT = 5600
METRICS_PORT = 9100


def dynabatch_command(argv: list[str]) -> list[str]:
    """`dynabatch ARGV` as a user types it: the console script next to this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "dynabatch"
    return [str(script), *argv] if script.exists() else command_line(argv[0], argv[1:])


@dataclass
class HostedJob:
    """One job on `net`'s hosts; `stop()` ends every process it started."""

    net: Network
    log_dir: Path
    curve_dir: str = ""
    scheduler_host: Host | None = None
    launcher: Launcher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = Launcher(self.log_dir)
        self.keys = keys_per_role(self.curve_dir, self.log_dir) if self.curve_dir else {}
        self.metrics_ports: dict[str, list[int]] = {}  # by host: the /metrics port of each process started there

    def _start(self, host: Host, name: str, role: str, argv: list[str]) -> Child:
        curve = ["--curve-dir", self.keys[role]] if self.keys else []
        ports = self.metrics_ports.setdefault(host.name, [])
        ports.append(METRICS_PORT + len(ports))
        cmd = host.command(
            dynabatch_command([*argv, *curve, "--metrics-host", "0.0.0.0", "--metrics-port", str(ports[-1])])
        )
        return self.launcher.spawn(name, role, cmd, serves_metrics=True)

    @property
    def scheduler_endpoint(self) -> str:
        assert self.scheduler_host is not None, "start the scheduler first"
        return f"tcp://{self.scheduler_host.name}:{SCHEDULER_PORT}"

    def scheduler(self, host: Host, *job_flags: str) -> Child:
        """`dynabatch scheduler --bind tcp://0.0.0.0:5555 JOB_FLAGS` on `host`: the job is configured here only."""
        self.scheduler_host = host
        return self._start(
            host, "scheduler", "scheduler", ["scheduler", "--bind", f"tcp://0.0.0.0:{SCHEDULER_PORT}", *job_flags]
        )

    def shard(self, host: Host, *flags: str) -> Child:
        """`dynabatch ps --scheduler tcp://A:5555 --bind tcp://0.0.0.0:5600 --advertise tcp://HOST:5600` on `host`."""
        return self._start(
            host,
            f"ps-{host.name}",
            "ps",
            [
                "ps",
                "--scheduler",
                self.scheduler_endpoint,
                "--bind",
                f"tcp://0.0.0.0:{SHARD_PORT}",
                "--advertise",
                f"tcp://{host.name}:{SHARD_PORT}",
                *flags,
            ],
        )

    def worker(self, host: Host, *flags: str, evaluator: bool = False) -> Child:
        """`dynabatch worker --scheduler tcp://A:5555` (with `--evaluator`) on `host` (its default name: HOST-PID)."""
        role = "evaluator" if evaluator else "worker"
        return self._start(
            host,
            f"{role}-{host.name}",
            role,
            ["worker", "--scheduler", self.scheduler_endpoint, *flags, *(["--evaluator"] if evaluator else [])],
        )

    def metrics(self, host: Host, nth: int = 0) -> str:
        """The /metrics page of the `nth` dynabatch process started on `host`, read from that host."""
        return host.get(f"http://127.0.0.1:{self.metrics_ports[host.name][nth]}/metrics").decode()

    def value(self, host: Host, name: str, nth: int = 0, **labels: str) -> float:
        """One series (summed over the labels not given) of a process on `host`; 0 if it is absent."""
        return metric_sum(self.metrics(host, nth), name, **labels)

    def stop(self) -> None:
        self.launcher.stop_all()
