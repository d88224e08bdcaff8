"""Which workers Ringmaster would always discard: the one rule the scheduler, the simulator and the predictor share.

Ringmaster ASGD (Maranjyan, Tyurin, Richtarik, ICML 2025) discards a gradient whose delay reaches R. While a worker
computes one step of t_i seconds, each worker whose gradients are applied makes t_i / t_j versions. Sorted by step
time, the fastest are kept while the slowest kept one's mean delay, t_k x sum_{j<k} 1/t_j, stays below R (a faster
worker's is smaller, so it is the one to check); every slower worker has some or all of its gradients discarded. Its
delay is always at least sum_j floor(t_i / t_j) over the kept workers j (each completes that many whole steps
within one of its steps, whatever the phase): where that reaches R, every one of its gradients arrives too stale and
its computation is irrelevant. The paper stops such computations: the scheduler gives that worker no batch (it stays
registered and alive), and gives it one back once the same rule says its steps would count: once its mean delay is
at most R - 1, the largest delay Ringmaster applies. A worker between the two (its least delay below R, its mean
above R - 1) keeps computing if it trains and stays idle if it is idle: the band keeps a worker whose step times
are measured with noise, or shift with the load of a shared host, from going back and forth.

The step times are each worker's at the split every worker would get, idle ones included; the others keep their
batches while a worker is idle (its allotment of the job's samples goes to them), so idling changes nothing the rule
reads and does not by itself bring the worker back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

W = TypeVar("W", str, int)
"""A worker's key: its id in the scheduler, its index in the predictor's cluster."""

EXACT = 1e-9
"""Relative slack on a ratio of step times, so that a step exactly twice another's counts two of them."""


def kept_prefix(steps_s: Sequence[float], threshold: int) -> int:
    """How many of `steps_s` (step seconds, fastest first) keep their delay below `threshold` (R); at least one."""
    updates, kept = 0.0, 0
    for step in steps_s:
        if updates * step >= threshold:
            break
        updates, kept = updates + 1 / step, kept + 1
    return max(1, kept)


@dataclass(frozen=True)
class Discarded:
    """A worker beyond Ringmaster's threshold: its gradients arrive `mean` versions stale on average, at least R
    (`threshold`), and never fewer than `least`."""

    mean: float
    least: int
    threshold: int

    @property
    def always(self) -> bool:
        """Whether every one of its gradients would be discarded."""
        return self.least >= self.threshold

    @property
    def reason(self) -> str:
        return f"Ringmaster would discard its steps: delay {self.mean:.1f} >= R {self.threshold}"


def delays(steps_s: Mapping[W, float], threshold: int) -> dict[W, Discarded]:
    """Every worker of `steps_s` (worker -> its step seconds) with its mean and least delay: the versions and the
    whole steps the kept workers (the fastest, by `kept_prefix`) other than itself make during one of its steps. A
    kept worker's mean delay is below `threshold`; every other worker's reaches it."""
    ranked = sorted(steps_s, key=lambda w: (steps_s[w], w))
    kept = ranked[: kept_prefix([steps_s[w] for w in ranked], threshold)]
    return {
        w: Discarded(
            steps_s[w] * sum(1 / steps_s[k] for k in kept if k != w),
            sum(math.floor(steps_s[w] / steps_s[k] * (1 + EXACT)) for k in kept if k != w),
            threshold,
        )
        for w in ranked
    }


def discarded_workers(steps_s: Mapping[W, float], threshold: int) -> dict[W, Discarded]:
    """The workers of `steps_s` whose mean delay reaches `threshold` (`delays`): some or all of their gradients are
    discarded; the fastest worker is always kept."""
    return {w: d for w, d in delays(steps_s, threshold).items() if d.mean >= threshold}
