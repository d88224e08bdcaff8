"""The worker's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dynabatch.common.flags import ConfigError, opt
from dynabatch.common.shared_options import MemberOptions, TrainingOptions
from dynabatch.common.slowdown import MAX_SLOWDOWN_CHARS, Slowdown

# What torch.device accepts of cpu and cuda, read without importing torch (the flags are checked before it loads).
DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


@dataclass
class WorkerOptions(MemberOptions, TrainingOptions):
    """A worker's own settings; its job, task and training flags are shared (common/shared_options.py)."""

    slowdown: str = opt(
        "1", "emulated slowdown: a factor (4) or a schedule in seconds of training (1x,4x@60s,1x@120s)", topic="cluster"
    )
    evaluator: bool = opt(False, "only pull the model and report test loss and accuracy", topic="cluster")
    probe_steps: int = opt(9, "timed steps to measure standalone speed before joining", minimum=1, topic="cluster")
    request_timeout_s: float = opt(
        30.0, "give up on a shard request after this long, then retry", minimum=0.1, topic="cluster"
    )
    device: str = opt(
        "cpu",
        "where the model computes: cpu, cuda or cuda:N (parameters and gradients travel from the CPU)",
        topic="cluster",
    )
    max_batch: int = opt(
        0,
        "this machine's largest batch (its memory); the scheduler never assigns it more "
        "(0: only the job's --max-batch)",
        minimum=0,
        topic="cluster",
    )

    def validate(self) -> None:
        MemberOptions.validate(self)
        TrainingOptions.validate(self)
        try:
            label = Slowdown.parse(self.slowdown).label()
        except ValueError as exc:
            raise ConfigError(f"--slowdown: {exc}") from None
        if len(label) > MAX_SLOWDOWN_CHARS:  # the scheduler would refuse its HELLO
            raise ConfigError(f"--slowdown: {label!r} is longer than {MAX_SLOWDOWN_CHARS} characters")
        if not DEVICE.fullmatch(self.device):
            raise ConfigError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")
