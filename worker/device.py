"""The device `--device` names, if this machine has it."""

from __future__ import annotations

import torch

from dynabatch.common.flags import ConfigError


def usable_device(text: str) -> torch.device:
    """The device named by --device if this machine has it; ConfigError otherwise.

    Checked when the worker starts, not in `WorkerOptions.validate`, which must also accept a GPU
    pool's settings on a machine without a GPU (the manifests' tests do that).
    """
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {text}: no CUDA device here (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device
