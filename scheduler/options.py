"""The scheduler's own settings; it also owns the whole JobConfig."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.flags import opt, validate_fields
from dynabatch.common.net.endpoint import check_endpoint


@dataclass
class SchedulerOptions:
    bind: str = opt(
        "tcp://127.0.0.1:5555",
        "control endpoint to bind; loopback unless told otherwise: tcp://0.0.0.0:5555 for processes on other machines",
        topic="cluster",
    )
    state_dir: str = opt(
        "",
        "folder for the job's progress (scheduler-JOB.json), saved every second and at each "
        "evaluation; a restarted scheduler resumes the job from it (empty: none)",
        topic="cluster",
    )
    log_every_s: float = opt(
        10.0,
        "seconds between two progress lines in the log: epoch, samples/s, workers, loss (0: none)",
        minimum=0.0,
        topic="observability",
    )
    exit_on_finish: bool = opt(
        True,
        "exit once the job has finished and its shards are told (off: serve STATUS until stopped)",
        topic="cluster",
    )
    hello_rate_per_s: float = opt(
        10.0,
        "new members one source (peer address) may register per second, once its "
        "--hello-burst is spent (re-joins of a registered process are free)",
        minimum=0.001,
        topic="security",
    )
    hello_burst: int = opt(
        0,
        "new members one source may register at once (0: twice --max-workers plus the shards)",
        minimum=0,
        topic="security",
    )

    def validate(self) -> None:
        validate_fields(self)
        check_endpoint("--bind", self.bind)
