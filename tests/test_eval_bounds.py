"""common/wire/eval_bounds.py: an evaluation's accuracy-like figures are fractions, every figure finite (test_acc NaN
only where the task computes no accuracy)."""

from __future__ import annotations

import math

import pytest
import torch

import dynabatch as db
from dynabatch.common.wire.eval_bounds import eval_problem
from dynabatch.common.wire.messages import EvalReport
from dynabatch.worker.evaluator import evaluate


@pytest.mark.parametrize(
    "report, field",
    [
        (EvalReport(version=1, test_loss=0.3, test_acc=7.0), "EVAL.test_acc"),
        (EvalReport(version=1, test_loss=0.3, test_acc=-1.0), "EVAL.test_acc"),
        (EvalReport(version=1, test_loss=math.inf, test_acc=0.5), "EVAL.test_loss"),
        (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"top5": 1.5}), "EVAL.metrics['top5']"),
        (
            EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"val_accuracy": -0.1}),
            "EVAL.metrics['val_accuracy']",
        ),
        (
            EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"perplexity": -math.inf}),
            "EVAL.metrics['perplexity']",
        ),
        (EvalReport(version=1, test_loss=math.nan, test_acc=0.5), "EVAL.test_loss"),
        (EvalReport(version=1, test_loss=0.3, test_acc=0.5, metrics={"f1": math.nan}), "EVAL.metrics['f1']"),
        (EvalReport(version=1, test_loss=0.3, test_acc=math.nan, metrics={"accuracy": 0.5}), "EVAL.test_acc"),
        (EvalReport(version=1, test_loss=0.3, test_acc=0.9, metrics={"accuracy": 0.5}), "EVAL.test_acc"),
    ],
)
def test_figures_out_of_their_range_are_named(report: EvalReport, field: str) -> None:
    problem = eval_problem(report)
    assert problem is not None and problem.startswith(field), problem


def test_fractions_in_range_other_metrics_of_any_size_and_a_task_without_accuracy_pass() -> None:
    assert (
        eval_problem(
            EvalReport(
                version=1,
                test_loss=12.0,
                test_acc=1.0,
                metrics={"accuracy": 1.0, "top2": 1.0, "perplexity": 4e5, "f1": 0.0},
            )
        )
        is None
    )
    assert eval_problem(EvalReport(version=1, test_loss=0.3, test_acc=math.nan, metrics={"loss": 0.3})) is None, (
        "NaN test_acc: the task computes no accuracy"
    )


def test_an_evaluators_metric_that_counted_nothing_is_left_out_so_its_report_is_in_bounds() -> None:
    def never(model: torch.nn.Module, batch: object) -> dict[str, tuple[float, float]]:
        return {"never": (0.0, 0.0)}  # e.g. a precision when no sample is predicted positive

    data = torch.utils.data.TensorDataset(torch.randn(40, 2), torch.randint(0, 2, (40,)))
    task = db.Task(model=lambda: torch.nn.Linear(2, 2), train_data=lambda: data, metrics=[db.metrics.accuracy, never])
    metrics = evaluate(task, torch.nn.Linear(2, 2), data, torch.device("cpu"))
    assert metrics.keys() == {"loss", "accuracy"}
    report = EvalReport(version=1, test_loss=metrics["loss"], test_acc=metrics["accuracy"], metrics=metrics)
    assert eval_problem(report) is None
