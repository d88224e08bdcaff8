"""common/eval_bounds.py: an evaluation's accuracy-like figures are fractions, every figure finite (test_acc NaN
only where the task computes no accuracy)."""

from __future__ import annotations

import math

import pytest

from dynabatch.common.eval_bounds import eval_problem
from dynabatch.common.messages import EvalReport


@pytest.mark.parametrize("report, field", [
    (EvalReport(version=1, test_loss=0.3, test_acc=7.0), "EVAL.test_acc"),
    (EvalReport(version=1, test_loss=0.3, test_acc=-1.0), "EVAL.test_acc"),
    (EvalReport(version=1, test_loss=math.inf, test_acc=0.5), "EVAL.test_loss"),
    (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"top5": 1.5}), "EVAL.metrics['top5']"),
    (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"val_accuracy": -0.1}),
     "EVAL.metrics['val_accuracy']"),
    (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"perplexity": -math.inf}),
     "EVAL.metrics['perplexity']"),
    (EvalReport(version=1, test_loss=math.nan, test_acc=0.5), "EVAL.test_loss"),
    (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"f1": math.nan}), "EVAL.metrics['f1']"),
    (EvalReport(version=1, test_loss=0.3, test_acc=math.nan, metrics={"accuracy": 0.5}), "EVAL.test_acc"),
    (EvalReport(version=1, test_loss=0.3, test_acc=0.9, metrics={"accuracy": 0.5}), "EVAL.test_acc"),
])
def test_figures_out_of_their_range_are_named(report, field):
    problem = eval_problem(report)
    assert problem is not None and problem.startswith(field), problem


def test_fractions_in_range_other_metrics_of_any_size_and_a_task_without_accuracy_pass():
    assert eval_problem(EvalReport(version=1, test_loss=12.0, test_acc=1.0,
                                   metrics={"accuracy": 1.0, "top2": 1.0, "perplexity": 4e5, "f1": 0.0})) is None
    assert eval_problem(EvalReport(version=1, test_loss=0.3, test_acc=math.nan, metrics={"loss": 0.3})) is None, \
        "NaN test_acc: the task computes no accuracy"
