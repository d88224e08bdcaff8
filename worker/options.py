"""The worker's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynabatch.common.endpoint import check_endpoint
from dynabatch.common.flags import ConfigError, opt, validate_fields
from dynabatch.common.metrics import ON_FINISH
from dynabatch.common.slowdown import Slowdown


@dataclass
class WorkerOptions:
    scheduler: str = opt("tcp://127.0.0.1:5555", "scheduler control endpoint")
    job: str = opt("dynabatch", "job name to join")
    task: str = opt("", "what to train: FILE.py:ATTR or package.module:ATTR naming a dynabatch.Task "
                    "(default: the job's --model on its --dataset)")
    data_dir: str = opt("", "folder with the built-in datasets' files (default: search the standard places)")
    init: str = opt("", "start from these weights: a state_dict file (torch.save, dynabatch export) loaded into the "
                    "task's model; the worker that initialises the shards sends them, frozen parameters and "
                    "buffers come from it on every worker")
    slowdown: str = opt("1", "emulated slowdown: a factor (4) or a schedule in seconds of training (1x,4x@60s,1x@120s)")
    evaluator: bool = opt(False, "only pull the model and report test loss and accuracy")
    threads: int = opt(1, "torch threads for compute", minimum=1)
    name: str = opt("", "name in logs and dashboards (default: HOST-PID)")
    probe_steps: int = opt(9, "timed steps to measure standalone speed before joining", minimum=1)
    request_timeout_s: float = opt(30.0, "give up on a shard request after this long, then retry", minimum=0.1)
    device: str = opt("cpu", "where the model computes: cpu, cuda or cuda:N (parameters and gradients travel from the CPU)")
    on_finish: str = opt("exit", "when the job ends: exit, or idle serving /healthz until stopped (Kubernetes)", ON_FINISH)
    max_batch: int = opt(0, "this machine's largest batch (its memory); the scheduler never assigns it more "
                         "(0: only the job's --max-batch)", minimum=0)
    micro_batch: int = opt(0, "run an assigned batch as passes of at most this many samples, accumulating "
                           "their gradients (0: one pass); not with the job's --pipeline on", minimum=0)
    loader_workers: int = opt(0, "processes loading batches ahead (a torch DataLoader whose batch sampler "
                              "follows the assigned batch size); 0: load in the worker's own process", minimum=0)

    def validate(self) -> None:
        validate_fields(self)
        check_endpoint("--scheduler", self.scheduler)
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
