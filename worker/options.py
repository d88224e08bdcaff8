"""The worker's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.config import ConfigError, opt, validate_fields
from dynabatch.common.slowdown import Slowdown


@dataclass
class WorkerOptions:
    scheduler: str = opt("tcp://127.0.0.1:5555", "scheduler control endpoint")
    job: str = opt("dynabatch", "job name to join")
    data_dir: str = opt("", "folder with the dataset files (default: search the standard places)")
    slowdown: str = opt("1", "emulated slowdown: a factor (4) or a schedule (1x,4x@60s,1x@120s)")
    evaluator: bool = opt(False, "only pull the model and report test loss and accuracy")
    threads: int = opt(1, "torch threads for compute", minimum=1)
    name: str = opt("", "name in logs and dashboards (default: HOST-PID)")
    probe_steps: int = opt(9, "timed steps to measure standalone speed before joining", minimum=1)
    request_timeout_s: float = opt(30.0, "give up on a shard request after this long, then retry", minimum=0.1)

    def validate(self) -> None:
        validate_fields(self)
        try:
            Slowdown.parse(self.slowdown)
        except ValueError as exc:
            raise ConfigError(f"--slowdown: {exc}") from None
