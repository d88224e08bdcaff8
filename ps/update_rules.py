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

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SGDConfig:
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


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


def dbs_weight(samples: int, global_batch: int, workers: int) -> float:
    """DBS-SGD's gradient weight b_i / (B/n): a larger batch moves the model further.

    Under the fixed policy every b_i is B/n and the weight is 1.
    """
    return samples * max(1, workers) / global_batch


@dataclass
class SyncRound:
    """One bulk-synchronous round: every live worker's contribution, averaged by samples.

    Contributions are kept per worker and summed in worker-id order when the
    round closes, so the result does not depend on arrival order: the same
    job gives the same parameters bit for bit, with one shard or several.
    """

    parts: dict[str, tuple[dict[int, torch.Tensor], int]] = field(default_factory=dict)

    @property
    def contributors(self) -> set[str]:
        return set(self.parts)

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.parts.values())

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, worker: str, grads: dict[int, torch.Tensor], samples: int) -> None:
        if worker in self.parts:
            raise ValueError(f"{worker} already pushed in this round")
        self.parts[worker] = (grads, samples)

    def complete(self, live: set[str]) -> bool:
        """Every live worker has pushed (workers that left are not waited for)."""
        return bool(self.parts) and live <= self.contributors

    def mean(self) -> dict[int, torch.Tensor]:
        """sum(b_i g_i) / sum(b_i) per chunk, summed in worker-id order."""
        total = self.samples
        out: dict[int, torch.Tensor] = {}
        for worker in sorted(self.parts):
            grads, samples = self.parts[worker]
            for cid, g in grads.items():
                if cid in out:
                    out[cid].add_(g, alpha=samples / total)
                else:
                    out[cid] = g.mul(samples / total)
        return out


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


@dataclass
class SoftRound:
    """n-softsync: gradients from any workers until `needed` have arrived.

    Unlike SyncRound a fast worker may contribute twice; each gradient keeps
    the staleness it had on arrival, for the lr / max(1, tau) scaling.
    """

    entries: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, grad: torch.Tensor, samples: int, staleness: int) -> None:
        self.entries.append((grad, samples, staleness))

    def combined(self) -> torch.Tensor:
        """sum(b_i g_i / max(1, tau_i)) / sum(b_i): the sample-weighted, staleness-damped mean."""
        total = sum(samples for _, samples, _ in self.entries)
        out = torch.zeros_like(self.entries[0][0])
        for grad, samples, staleness in self.entries:
            out.add_(grad, alpha=samples / max(1, staleness) / total)
        return out


def softsync_needed(live_workers: int, n: int) -> int:
    """c = floor(workers / n), at least 1: how many gradients an n-softsync update waits for."""
    return max(1, live_workers // max(1, n))
