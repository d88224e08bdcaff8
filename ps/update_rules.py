"""How a shard turns gradients into new parameters: pure tensor functions.

The optimizer is SGD with momentum, weight decay and optional Nesterov, the same
arithmetic as torch.optim.SGD (dampening 0) applied to flat chunk buffers.
Parameters are never written in place: each step returns a new tensor. A shard
answers pulls with zero-copy views of its current tensors, and ZeroMQ may still
be sending one of them when the next push arrives; replacing instead of
mutating keeps every in-flight reply consistent at no extra cost (the update
has to write its result somewhere anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dynabatch.common.config import JobConfig
from dynabatch.common.wire import ProtocolError


@dataclass(frozen=True)
class SGDConfig:
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


def sgd_config(job: JobConfig, optimizer: dict[str, Any]) -> SGDConfig:
    """The shards' SGD: the task's optimizer spec (common/optim_spec.py) if it sent one, else the job's flags.

    ProtocolError for an optimizer the shards do not apply, or a spec that is not SGD's.
    """
    if not optimizer:
        return SGDConfig(job.lr, job.momentum, job.weight_decay, job.nesterov)
    name = optimizer.get("name")
    if name != "sgd":
        raise ProtocolError("bad_field", f"optimizer {name!r} is not applied by the shards (they apply sgd)")
    try:
        cfg = SGDConfig(float(optimizer["lr"]), float(optimizer.get("momentum", 0.0)),
                        float(optimizer.get("weight_decay", 0.0)), bool(optimizer.get("nesterov", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", f"optimizer spec {optimizer!r}: {exc}") from None
    if not all(math.isfinite(v) and v >= 0 for v in (cfg.lr, cfg.momentum, cfg.weight_decay)):
        raise ProtocolError("bad_field", f"optimizer spec {optimizer!r}: rates must be finite and non-negative")
    return cfg


def sgd_step(
    param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, cfg: SGDConfig, lr_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step; returns (new parameters, momentum buffer).

    The momentum buffer is the shard's private state and is updated in place;
    the parameters are not (see above). `buf` starts as zeros, which makes the
    first step equal to torch's (momentum * 0 + d == d). `lr_scale` carries
    per-gradient weights such as DBS-SGD's b_i / (B/n). Each step allocates one
    new tensor, the parameters: allocation (page faults) is what a step costs.
    """
    lr = cfg.lr * lr_scale
    if not cfg.momentum:
        d = grad if cfg.weight_decay == 0 else grad.add(param, alpha=cfg.weight_decay)
        return param.add(d, alpha=-lr), buf
    buf.mul_(cfg.momentum).add_(grad)
    if cfg.weight_decay:
        buf.add_(param, alpha=cfg.weight_decay)
    if not cfg.nesterov:
        return param.add(buf, alpha=-lr), buf
    new = param.add(buf, alpha=-lr * cfg.momentum).add_(grad, alpha=-lr)  # d = g + wd*w + m*buf
    if cfg.weight_decay:
        new.add_(param, alpha=-lr * cfg.weight_decay)
    return new, buf


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer of the delta protocols (local, msd).

    lr 1 and momentum 0 is plain model averaging; DiLoCo uses lr 0.7 with
    Nesterov momentum 0.9.
    """

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True


def outer_step(
    param: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor, cfg: OuterConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the mean parameter delta (global minus local: a pseudo-gradient); returns (params, buffer)."""
    if cfg.momentum:
        buf = buf.mul(cfg.momentum).add_(delta)
        delta = delta.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
    return param.add(delta, alpha=-cfg.lr), buf
