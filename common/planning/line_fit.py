"""A step-time line t(b) = a + c*b by least squares: how `dynabatch check` and `dynabatch plan` read a worker's
fixed and per-sample cost from steps timed at several batch sizes (the scheduler keeps its own windowed fit)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (a, c) of y = a + c*x over at least two distinct x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs at least two distinct batch sizes")
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - c * mx, c
