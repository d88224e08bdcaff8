"""How a closed round's contributions become one update (`--aggregation`): pure functions of the contributions.

A contribution is one worker's per-sample quantity for the round and its samples b_i: its mean gradient over
its batch (ssgd, rennala; softsync's each damped by its staleness) or its parameter delta (local, msd). What
a worker pushes is already a mean over its batch, so nothing is divided by samples here: the rounds add up a
worker's several pushes (softsync, rennala) and hand over its per-sample mean (protocol_rules.py).

- `mean`: sum(b_i x_i) / sum(b_i), the sample-weighted mean the rounds have always applied.
- `trimmed-mean`: the coordinate-wise trimmed mean of Yin, Chen, Ramchandran and Bartlett, "Byzantine-robust
  distributed learning: towards optimal statistical rates" (ICML 2018, Definition 2): for each coordinate,
  the contributions are ordered by value and the k lowest and k highest are dropped, k = ceil(trim * n) of
  the n workers, at most (n - 1) / 2.
- `median`: their coordinate-wise median (Definition 1): k = (n - 1) // 2, the middle value for odd n.

How samples enter: trimming votes by worker, averaging weighs by samples. A value is dropped for where it
lies among the workers' values whatever its samples claim (a Byzantine worker is one worker), and the kept
ones are averaged weighted by their samples, so a rule that trims nothing is the mean, and under fixed
batches (equal b_i) these are exactly Yin et al.'s rules. As long as at most k workers lie, every kept value
of a coordinate lies between two honest workers' values, so a liar's value and its samples can move the
result only within the honest workers' range. For even n the median is the sample-weighted mean of the two
middle values. k is rounded up so that the default trim of 0.2 drops one worker at each end from 3 workers
on (rounded down it trimmed nothing below 5 workers, and a single liar is what the rule is for).

Fewer than 3 contributions: both robust rules are the mean (k = 0). With two, either may be the liar and
nothing tells which; the median of two values is their mean anyway.

Every result is a convex combination of values at the same coordinate (the weights are normalised before
they multiply), so finite contributions never give an overflow to inf, or a NaN.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

from dynabatch.common.protocols import RoundSettings

Contribution = tuple[torch.Tensor, int]  # one worker's per-sample tensor for the round, and its samples


def weighted_mean(parts: Sequence[Contribution]) -> torch.Tensor:
    """sum(b_i x_i) / sum(b_i), summed in the order given; never writes into a given tensor."""
    total = sum(samples for _, samples in parts)
    out: torch.Tensor | None = None
    for tensor, samples in parts:
        out = tensor.mul(samples / total) if out is None else out.add_(tensor, alpha=samples / total)
    assert out is not None, "mean of an empty round"
    return out


def trimmed_count(workers: int, trim: float) -> int:
    """k, the contributions a trimmed mean drops at each end of a coordinate: ceil(trim * n), at most
    (n - 1) // 2 so that one is kept (rounded to 9 places first, so that 0.3 * 10 is 3, not 4)."""
    return min(math.ceil(round(trim * workers, 9)), (workers - 1) // 2)


def trimmed_mean(parts: Sequence[Contribution], k: int) -> torch.Tensor:
    """For each coordinate, drop the k lowest and k highest values and average the rest by samples.

    Ranks, not a sort: each pair of contributions is compared once, coordinate by coordinate, and a
    contribution's rank at a coordinate is how many lie below it there. That is n(n - 1)/2 passes over a chunk
    and a few per contribution, and no n x chunk copy; for few workers it is faster than torch's sort along the
    workers, and its cost grows as n^2, so a robust rule is for small rounds (the measured costs are in
    docs/operators.md, "Robust aggregation for rounds"). Equal values are ranked by the contributions' order,
    which is by samples first, so the values kept do not depend on the order of `parts` (two equal in value and
    samples are interchangeable); their sum's rounding may.
    """
    if not 0 <= 2 * k < len(parts):
        raise ValueError(f"cannot drop {k} of {len(parts)} contributions at each end")
    if k == 0:
        return weighted_mean(parts)
    by_samples = sorted(parts, key=lambda part: part[1])
    values = [tensor for tensor, _ in by_samples]
    ranks = [torch.zeros(value.shape, dtype=torch.int16) for value in values]  # up to 32767 workers
    for a, b in itertools.combinations(range(len(values)), 2):
        below = values[b] < values[a]  # at a tie, the earlier contribution ranks lower
        ranks[a] += below
        ranks[b] += ~below
    weights = [
        ((rank >= k) & (rank < len(values) - k)).to(value.dtype).mul_(samples)
        for rank, value, (_, samples) in zip(ranks, values, by_samples, strict=True)
    ]
    kept_samples = functools.reduce(torch.add, weights)
    out = torch.zeros_like(values[0])
    for value, weight in zip(values, weights, strict=True):
        out.addcmul_(value, weight.div_(kept_samples))  # a weight of at most 1: no overflow, whatever the values
    return out


def aggregate(parts: Sequence[Contribution], settings: RoundSettings) -> torch.Tensor:
    """The round's update from its contributions (one per worker, in worker-id order) under `settings`'
    aggregation (common/protocols.py, AGGREGATIONS)."""
    if settings.aggregation == "mean":
        return weighted_mean(parts)
    if settings.aggregation == "trimmed-mean":
        return trimmed_mean(parts, trimmed_count(len(parts), settings.trim))
    if settings.aggregation == "median":
        return trimmed_mean(parts, (len(parts) - 1) // 2)
    raise ValueError(f"unknown aggregation {settings.aggregation!r}")
