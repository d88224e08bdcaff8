"""How a shard turns gradients into new parameters: one optimizer per chunk.

Parameters a reply may still be sending are never written. A shard answers
pulls with zero-copy views of its current tensors, and ZeroMQ may still be
sending one of them when the next push arrives. SGD steps in place: the chunk's
parameters themselves when no reply holds them, else a copy in memory no reply
holds (ps/shard_state.py, ps/param_buffers.py); the other optimizers return a
new tensor. Optimizer state (momentum, Adam's moments) is the shard's private
state and is updated in place.

- SGD (`db.optim.SGD`, or the job's flags) is `sgd_step_`: torch.optim.SGD's
  arithmetic (dampening 0) in torch's fused kernel, one pass over parameters,
  gradient and momentum (see `ExactSGD` for why it is not torch's class).
- Adam and AdamW are torch's own optimizers (`TorchChunkOptimizer`). torch
  updates in place, so a step copies the chunk's current parameters, points the
  optimizer's parameters (views of that copy) at it, steps, and publishes the
  copy; the tensor a pull may still be sending is never touched.
- Parameter groups: a parameter whose name contains one of the spec's
  `no_decay` substrings gets weight decay 0. The shard knows every parameter's
  name and size from the model's signature, so each chunk is cut into runs of
  parameters that share a weight decay; Adam, AdamW and SGD act element by
  element, so one view per run gives the same result as one per parameter.
- Under asynchronous protocols (asgd, ssp; softsync, whose closed round counts
  as one gradient of all its samples) an adaptive optimizer sums the gradients
  it is offered, weighted by their samples, and steps once at least B samples
  (the job's global batch) are in, on the mean of all of them (no gradient is
  split, so a step may hold a little more than B). One Adam step thus means one
  batch of B however the workers' batches are split; SGD steps on every
  gradient, weighted by DBS-SGD's b_i / (B/n): the weight scales what the
  gradient adds to the momentum buffer, not the rate of the step that carries
  the buffer (`sgd_step_`). Under ssgd a round is one step of either.
- The delta protocols (local, msd) apply the outer optimizer (`OuterOptimizer`).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from dynabatch.common.base_lr import base_lr
from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import OuterSettings
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.optim import SGD, Adam, OptimizerSpec, optimizer_from_fields

Segment = tuple[int, int, float]  # [start, stop) and the weight decay of a run of parameters


def optimizer_spec(job: JobConfig, fields: dict[str, Any]) -> OptimizerSpec:
    """The shards' optimizer: the task's spec if the first worker sent one, else SGD from the job's flags (its
    `--lr`, or the default for the step rule it runs: common/base_lr.py).

    ProtocolError("bad_field") naming the malformed field of a peer's spec (api/optim.py).
    """
    if not fields:
        return SGD(lr=base_lr(job), momentum=job.momentum, weight_decay=job.weight_decay, nesterov=job.nesterov)
    try:
        return optimizer_from_fields(fields)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"INIT: {exc}") from None


def decay_runs(params: Sequence[tuple[str, int]], spec: OptimizerSpec) -> list[Segment]:
    """The flat vector as runs of parameters (name, size, in flat order) that share a weight decay."""
    runs: list[Segment] = []
    offset = 0
    for name, size in params:
        decay = 0.0 if any(part in name for part in spec.no_decay) else spec.weight_decay
        if runs and runs[-1][2] == decay:
            runs[-1] = (runs[-1][0], offset + size, decay)
        elif size:
            runs.append((offset, offset + size, decay))
        offset += size
    return runs


def chunk_segments(runs: list[Segment], start: int, stop: int) -> list[Segment]:
    """The runs that overlap [start, stop), clipped to it and relative to `start`."""
    first = max(0, bisect.bisect_right([r[0] for r in runs], start) - 1)
    out = []
    for a, b, decay in runs[first:]:
        if a >= stop:
            break
        if b > start:
            out.append((max(a, start) - start, min(b, stop) - start, decay))
    return out


def sgd_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor,
    cfg: SGD,
    lr_scale: float = 1.0,
    segments: Sequence[Segment] = (),
    weight: float = 1.0,
) -> None:
    """One SGD step on `param` and its momentum buffer `buf`, both in place, by torch's fused kernel.

    One pass over memory where the same arithmetic in separate tensor operations takes five, and no new
    tensor (bench/RESULTS.md 16).
    `buf` starts as zeros, which makes the first step equal to torch's (momentum * 0 + d == d).
    `lr_scale` scales the rate of the whole step, momentum included (the schedule, the job's factor after
    rollbacks), as a change of torch's lr would. `weight` is this gradient's own weight (DBS-SGD's
    b_i / (B/n), a delay factor): buf = momentum * buf + weight * (grad + decay * param), so a gradient
    of few samples adds its share to the buffer that every worker's next step carries. Scaling the rate
    by it instead would let a 1-sample gradient into the buffer at full weight, to be applied at full rate
    by the next worker's step (bench/RESULTS.md 9g: what that costs a job with one worker at `--max-batch 1`).
    Without momentum the two are the same step; with weight 1 the weight changes nothing, bit for bit.
    `segments` (runs [start, stop) of the chunk and their weight decay) replace the spec's weight decay where a
    chunk holds parameters with and without decay; one kernel call per decay takes all of its runs.
    """
    if weight != 1.0:
        grad = grad.mul(weight)  # a new tensor: a received gradient's frame is never written
    groups: dict[float, list[tuple[int, int]]] = {}
    for a, b, decay in segments:
        groups.setdefault(decay, []).append((a, b))
    if len(groups) <= 1:
        decay = next(iter(groups), cfg.weight_decay)
        _fused_sgd([param], [grad], [buf], cfg, lr_scale, decay * weight)
        return
    for decay, runs in groups.items():
        _fused_sgd(
            [param[a:b] for a, b in runs],
            [grad[a:b] for a, b in runs],
            [buf[a:b] for a, b in runs],
            cfg,
            lr_scale,
            decay * weight,
        )


def _fused_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    cfg: SGD,
    lr_scale: float,
    decay: float,
) -> None:
    torch._fused_sgd_(
        params,
        grads,
        bufs if cfg.momentum else [],
        weight_decay=decay,
        momentum=cfg.momentum,
        lr=cfg.lr * lr_scale,
        dampening=0.0,
        nesterov=cfg.nesterov,
        maximize=False,
        is_first_step=False,
    )


def outer_step(
    param: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor, cfg: OuterSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the mean parameter delta (global minus local: a pseudo-gradient); returns (params, buffer)."""
    if cfg.momentum:
        buf = buf.mul(cfg.momentum).add_(delta)
        delta = delta.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
    return param.add(delta, alpha=-cfg.lr), buf


class ChunkOptimizer(ABC):
    """One chunk's optimizer: `step` takes the chunk's parameters and a gradient and returns new parameters.

    `offer` is how asynchronous protocols hand it a gradient of `samples`
    samples and weight `weight`: it steps now (SGD) or, for an adaptive optimizer,
    when B samples have been offered (None until then).
    """

    in_place: ClassVar[bool] = False  # steps by writing `param`: the shard passes it memory no reply holds

    @abstractmethod
    def step(self, param: torch.Tensor, grad: torch.Tensor, lr_factor: float, weight: float = 1.0) -> torch.Tensor:
        """The new parameters, one step from `param` at rate lr * lr_factor on `grad` weighted by `weight` (SGD
        weighs the gradient, the others scale their rate): `param` itself, updated in place (`in_place`), or
        a new tensor, `param` left as it is."""

    def offer(
        self, param: torch.Tensor, grad: torch.Tensor, samples: int, batch: int, lr_factor: float, weight: float
    ) -> torch.Tensor | None:
        return self.step(param, grad, lr_factor, weight)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps, by reference: the caller saves it before the next step."""

    @abstractmethod
    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s result, taken from an optimizer of the same chunk."""


class ExactSGD(ChunkOptimizer):
    """SGD by `sgd_step_`, not torch.optim.SGD: the same arithmetic (tests/test_update_rules.py proves them
    equal), without torch's per-call overhead, which would land on every pushed gradient of every chunk
    (under asgd SGD steps once per push, not once per B samples; bench/RESULTS.md 16 has the step with each,
    measured side by side).
    """

    in_place = True

    def __init__(self, spec: SGD, length: int, segments: list[Segment]) -> None:
        self.spec = spec
        self.buf = torch.zeros(length)
        self.segments = segments

    def step(self, param: torch.Tensor, grad: torch.Tensor, lr_factor: float, weight: float = 1.0) -> torch.Tensor:
        sgd_step_(param, grad, self.buf, self.spec, lr_factor, self.segments, weight)
        return param

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.buf}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.buf = saved["momentum"]


TORCH_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


class TorchChunkOptimizer(ChunkOptimizer):
    """torch.optim.Adam or AdamW over one chunk: one view per run of parameters, one group per weight decay.

    The views are re-pointed at a fresh copy of the chunk before every step
    (`Tensor.data`, which keeps the tensors torch keys its state by), so the
    optimizer updates the copy in place and the shard publishes it. Gradients
    offered asynchronously wait in `pending` (their sample-weighted sum) until
    B samples are in.
    """

    def __init__(self, spec: Adam, param: torch.Tensor, segments: list[Segment]) -> None:
        self.spec = spec
        self.segments = segments
        self.views = [param[a:b] for a, b, _ in segments]
        groups: dict[float, list[torch.Tensor]] = {}
        for view, (_, _, decay) in zip(self.views, segments, strict=True):
            groups.setdefault(decay, []).append(view)
        self.optimizer = TORCH_OPTIMIZERS[spec.name](
            [{"params": views, "weight_decay": decay} for decay, views in groups.items()],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
        )
        self.pending: torch.Tensor | None = None
        self.pending_samples = 0

    def step(self, param: torch.Tensor, grad: torch.Tensor, lr_factor: float, weight: float = 1.0) -> torch.Tensor:
        new = param.clone()
        for view, (a, b, _) in zip(self.views, self.segments, strict=True):
            view.data = new[a:b]
            view.grad = grad[a:b]
        for group in self.optimizer.param_groups:
            group["lr"] = self.spec.lr * lr_factor * weight
        self.optimizer.step()
        for view in self.views:
            view.grad = None  # a received gradient's frame is not kept alive by the optimizer
        return new

    def offer(
        self, param: torch.Tensor, grad: torch.Tensor, samples: int, batch: int, lr_factor: float, weight: float
    ) -> torch.Tensor | None:
        """Sum b_i g_i until at least B samples are in, then one step on their mean; `weight` is SGD's alone."""
        if self.pending is None and samples >= batch:
            return self.step(param, grad, lr_factor)
        self.pending = grad.mul(samples) if self.pending is None else self.pending.add_(grad, alpha=samples)
        self.pending_samples += samples
        if self.pending_samples < batch:
            return None
        mean = self.pending.div_(self.pending_samples)
        self.pending, self.pending_samples = None, 0
        return self.step(param, mean, lr_factor)

    def state_dict(self) -> dict[str, Any]:
        return {"torch": self.optimizer.state_dict(), "pending": self.pending, "pending_samples": self.pending_samples}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(saved["torch"])
        self.pending, self.pending_samples = saved["pending"], saved["pending_samples"]


class OuterOptimizer(ChunkOptimizer):
    """The delta protocols' outer optimizer on one chunk (its rate is --outer-lr: the task's schedule
    drives the workers' own steps, not the averaging)."""

    def __init__(self, cfg: OuterSettings, length: int) -> None:
        self.cfg = cfg
        self.buf = torch.zeros(length)

    def step(self, param: torch.Tensor, grad: torch.Tensor, lr_factor: float, weight: float = 1.0) -> torch.Tensor:
        new, self.buf = outer_step(param, grad, self.buf, self.cfg)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.buf}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.buf = saved["momentum"]


def chunk_optimizer(spec: OptimizerSpec, param: torch.Tensor, segments: list[Segment]) -> ChunkOptimizer:
    """The optimizer `spec` names, over one chunk whose current parameters are `param`."""
    if isinstance(spec, SGD):
        return ExactSGD(spec, param.numel(), segments)
    if isinstance(spec, Adam):
        return TorchChunkOptimizer(spec, param, segments)
    raise ValueError(f"no update rule for optimizer {spec.name!r}")
