"""Evaluations (scheduler/evaluations.py) driven directly: which evaluation is kept, and the final one."""

from __future__ import annotations

import pytest

from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport
from dynabatch.scheduler.evaluations import Evaluations
from dynabatch.scheduler.saved_progress import SavedProgress


def _report(version: int, acc: float = 0.5, final: bool = False) -> EvalReport:
    return EvalReport(version=version, test_loss=1.0, test_acc=acc, final=final)


def test_an_evaluation_that_cannot_be_is_refused() -> None:
    with pytest.raises(ProtocolError, match="beyond any version"):
        Evaluations.check(_report(11), newest_possible_version=10)
    with pytest.raises(ProtocolError, match="test_acc"):
        Evaluations.check(_report(1, acc=1.5), newest_possible_version=10)
    Evaluations.check(_report(10), newest_possible_version=10)


def test_the_newest_evaluation_is_kept() -> None:
    evaluations = Evaluations()
    evaluations.keep(_report(5, 0.5), 1.0, newest_shard_version=5, rollback_done=0, stopping=False)
    evaluations.keep(_report(3, 0.3), 2.0, newest_shard_version=5, rollback_done=0, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.test_acc == 0.5 and evaluations.eval_time == 1.0, (
        "an older version is not kept"
    )
    evaluations.keep(_report(7, 0.7), 3.0, newest_shard_version=5, rollback_done=0, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.version == 7 and evaluations.eval_time == 3.0


def test_after_a_rollback_the_first_evaluation_of_a_restored_version_replaces_the_diverged_ones() -> None:
    evaluations = Evaluations()
    evaluations.keep(_report(9, 0.1), 1.0, newest_shard_version=9, rollback_done=0, stopping=False)
    evaluations.keep(_report(4, 0.6), 2.0, newest_shard_version=9, rollback_done=0, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.version == 9, "before every shard restored its checkpoint"
    evaluations.keep(_report(5, 0.7), 3.0, newest_shard_version=4, rollback_done=1, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.version == 9, (
        "a version no shard holds yet is not of the restored model"
    )
    evaluations.keep(_report(4, 0.7), 3.0, newest_shard_version=4, rollback_done=1, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.version == 4 and evaluations.eval_rollbacks == 1
    evaluations.keep(_report(3, 0.2), 4.0, newest_shard_version=6, rollback_done=1, stopping=False)
    assert evaluations.eval is not None and evaluations.eval.version == 4, "and older ones are ignored again"


def test_the_final_evaluation_counts_only_once_the_job_is_stopping() -> None:
    evaluations = Evaluations()
    evaluations.keep(_report(3, final=True), 1.0, newest_shard_version=3, rollback_done=0, stopping=False)
    assert not evaluations.final_eval
    evaluations.keep(_report(4, final=True), 2.0, newest_shard_version=4, rollback_done=0, stopping=True)
    assert evaluations.final_eval and evaluations.eval.version == 4


def test_a_resumed_evaluation_is_of_the_restored_model() -> None:
    evaluations = Evaluations()
    evaluations.restore(SavedProgress(config={}, eval=_report(8), eval_time=12.0, final_eval=False))
    assert (
        evaluations.eval is not None
        and evaluations.eval.version == 8
        and evaluations.eval_time == 12.0
        and evaluations.eval_rollbacks == 0
    )
