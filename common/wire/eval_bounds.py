"""What an evaluation report (EVAL) may carry: a bounded set of short metric names with finite values.

The scheduler keeps the latest report, serves it in STATUS and exports each
metric as a Prometheus series labelled by its name, so the names bound that
series' cardinality: a task has at most MAX_EVAL_METRICS of them, each a short
printable string. Every value is a finite float: NaN and the infinities say
nothing about a model that STATUS, the run's summary or a `--target-metric` can
use, and a registered evaluator could otherwise blank the job's figures with
them. An honest evaluator leaves out a metric that counted no samples and
reports nothing for a model whose loss is not finite (the shards' parameter
guard and the scheduler's divergence watch own divergence). The one NaN kept
is `test_acc` of a task that computes no `accuracy` metric, its mark for "none";
where the metrics carry `accuracy`, `test_acc` must be that value. An
accuracy-like metric (`test_acc`, and a metric named `accuracy`, `acc`, `top<k>`
or ending in `_acc` / `_accuracy`) is a fraction of samples: outside [0, 1] it is
refused, so a registered evaluator cannot show the job a 700% accuracy.
"""

from __future__ import annotations

import math
import re

from dynabatch.common.wire.messages import EvalReport

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
    if not math.isfinite(value):
        return f"{value} is not a finite number"
    if fraction and not 0.0 <= value <= 1.0:
        return f"{value} is outside [0, 1] (a fraction of samples)"
    return None


def _test_acc_problem(report: EvalReport) -> str | None:
    """`test_acc` is the `accuracy` metric, or NaN where the task computes none."""
    accuracy = report.metrics.get("accuracy")
    if accuracy is None:
        return None if math.isnan(report.test_acc) else _value_problem(report.test_acc, True)
    if report.test_acc != accuracy:
        return f"{report.test_acc} is not EVAL.metrics['accuracy'] ({accuracy})"
    return None


def eval_problem(report: EvalReport) -> str | None:
    """Why `report` is out of bounds, naming the field (as `EVAL.metrics['name']`), or None."""
    if report.version < 0:
        return f"EVAL.version {report.version} is negative"
    problem = _value_problem(report.test_loss)
    if problem:
        return f"EVAL.test_loss: {problem}"
    if len(report.metrics) > MAX_EVAL_METRICS:
        return f"EVAL.metrics: {len(report.metrics)} metrics, at most {MAX_EVAL_METRICS}"
    for name, value in report.metrics.items():
        problem = metric_name_problem(name)
        if problem:
            return f"EVAL.metrics: {problem}"
        problem = _value_problem(value, ACCURACY_LIKE.fullmatch(name) is not None)
        if problem:
            return f"EVAL.metrics[{name!r}]: {problem}"
    problem = _test_acc_problem(report)
    return f"EVAL.test_acc: {problem}" if problem else None
