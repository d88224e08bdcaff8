"""Staleness counts: how many updates were k versions behind, as one short list.

Workers learn each update's staleness from the shard's PUSH_ACK and report the
counts in their heartbeats; the scheduler sums them over the job. Exact counts
(not a Prometheus histogram's buckets) give an exact mean and p99, and a list
of at most STALENESS_BINS integers keeps the heartbeat small.
"""

from __future__ import annotations

from dataclasses import dataclass

STALENESS_BINS = 64  # the last bin counts every staleness of 63 or more


def record(counts: list[int], staleness: int) -> None:
    """Count one update `staleness` versions behind (in place)."""
    k = min(max(0, staleness), STALENESS_BINS - 1)
    if len(counts) <= k:
        counts.extend([0] * (k + 1 - len(counts)))
    counts[k] += 1


def add(total: list[int], counts: list[int]) -> list[int]:
    """The element-wise sum of two count lists."""
    out = list(total) + [0] * max(0, len(counts) - len(total))
    for k, n in enumerate(counts):
        out[k] += n
    return out


def check(counts: list[int]) -> str | None:
    """Why `counts` is not a valid count list, or None."""
    if len(counts) > STALENESS_BINS:
        return f"{len(counts)} staleness bins, at most {STALENESS_BINS}"
    if any(n < 0 for n in counts):
        return "negative staleness count"
    return None


@dataclass(frozen=True)
class StalenessStats:
    """Mean and 99th percentile over every counted update (None when nothing was counted)."""

    updates: int
    mean: float | None
    p99: int | None


def stats(counts: list[int]) -> StalenessStats:
    total = sum(counts)
    if total == 0:
        return StalenessStats(0, None, None)
    mean = sum(k * n for k, n in enumerate(counts)) / total
    seen, p99 = 0, 0
    for k, n in enumerate(counts):
        seen += n
        if seen >= 0.99 * total:
            p99 = k
            break
    return StalenessStats(total, mean, p99)
