"""The worker's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynabatch.common.flags import ConfigError, opt
from dynabatch.common.shared_options import MemberOptions, TrainingOptions
from dynabatch.common.slowdown import Slowdown


@dataclass
class WorkerOptions(MemberOptions, TrainingOptions):
    """A worker's own settings; its job, task and training flags are shared (common/shared_options.py)."""

    slowdown: str = opt("1", "emulated slowdown: a factor (4) or a schedule in seconds of training "
                        "(1x,4x@60s,1x@120s)", topic="cluster")
    evaluator: bool = opt(False, "only pull the model and report test loss and accuracy", topic="cluster")
    probe_steps: int = opt(9, "timed steps to measure standalone speed before joining", minimum=1, topic="cluster")
    request_timeout_s: float = opt(30.0, "give up on a shard request after this long, then retry", minimum=0.1,
                                   topic="cluster")
    device: str = opt("cpu", "where the model computes: cpu, cuda or cuda:N (parameters and gradients travel from "
                      "the CPU)", topic="cluster")
    max_batch: int = opt(0, "this machine's largest batch (its memory); the scheduler never assigns it more "
                         "(0: only the job's --max-batch)", minimum=0, topic="cluster")

    def validate(self) -> None:
        MemberOptions.validate(self)
        TrainingOptions.validate(self)
        try:
            Slowdown.parse(self.slowdown)
        except ValueError as exc:
            raise ConfigError(f"--slowdown: {exc}") from None
        try:
            kind = torch.device(self.device).type
        except RuntimeError:
            kind = ""
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")


def usable_device(text: str) -> torch.device:
    """The device named by --device if this machine has it; ConfigError otherwise.

    Checked when the worker starts, not in `validate`, which must also accept a GPU
    pool's settings on a machine without a GPU (the manifests' tests do that).
    """
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {text}: no CUDA device here (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device
