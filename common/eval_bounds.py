"""What an evaluation report (EVAL) may carry: a bounded set of short metric names with real values.

The scheduler keeps the latest report, serves it in STATUS and exports each
metric as a Prometheus series labelled by its name, so the names bound that
series' cardinality: a task has at most MAX_EVAL_METRICS of them, each a short
printable string. A value is a finite float, or NaN: the evaluator's own mark
for a metric that counted no samples and for the loss of a diverged model,
which must still reach the run (a refused final evaluation would leave the job
waiting for one). Infinities mean nothing as a mean over samples. An
accuracy-like metric (`test_acc`, and a metric named `accuracy`, `acc`, `top<k>`
or ending in `_acc` / `_accuracy`) is a fraction of samples: outside [0, 1] it is
refused, so a registered evaluator cannot show the job a 700% accuracy.
"""

from __future__ import annotations

import math
import re

from dynabatch.common.messages import EvalReport

MAX_EVAL_METRICS = 32
MAX_METRIC_NAME_CHARS = 64
ACCURACY_LIKE = re.compile(r"(acc|accuracy|top\d+|.*_acc|.*_accuracy)", re.IGNORECASE)


def metric_name_problem(name: str) -> str | None:
    """Why `name` cannot name a metric, or None."""
    if not name or len(name) > MAX_METRIC_NAME_CHARS:
        return f"metric name {name[:MAX_METRIC_NAME_CHARS]!r} must have 1 to {MAX_METRIC_NAME_CHARS} characters"
    if not name.isprintable() or name != name.strip():
        return f"metric name {name!r} must be printable, without surrounding spaces"
    return None


def _value_problem(value: float, fraction: bool = False) -> str | None:
    if not (math.isfinite(value) or math.isnan(value)):
        return f"{value} is not a finite number (nor NaN)"
    if fraction and not (math.isnan(value) or 0.0 <= value <= 1.0):
        return f"{value} is outside [0, 1] (a fraction of samples)"
    return None


def eval_problem(report: EvalReport) -> str | None:
    """Why `report` is out of bounds, naming the field (as `EVAL.metrics['name']`), or None."""
    if report.version < 0:
        return f"EVAL.version {report.version} is negative"
    for field, value in (("test_loss", report.test_loss), ("test_acc", report.test_acc)):
        problem = _value_problem(value, field == "test_acc")
        if problem:
            return f"EVAL.{field}: {problem}"
    if len(report.metrics) > MAX_EVAL_METRICS:
        return f"EVAL.metrics: {len(report.metrics)} metrics, at most {MAX_EVAL_METRICS}"
    for name, value in report.metrics.items():
        problem = metric_name_problem(name)
        if problem:
            return f"EVAL.metrics: {problem}"
        problem = _value_problem(value, ACCURACY_LIKE.fullmatch(name) is not None)
        if problem:
            return f"EVAL.metrics[{name!r}]: {problem}"
    return None
