"""The model's latest evaluation, and whether the final model has been evaluated.

Only an evaluator reports one, of a version the shards can have reached, within
common/wire/eval_bounds.py; anything else is refused and changes nothing. After a
rollback the model's version is lower than the evaluation's of the diverged model:
the first evaluation of a restored version replaces it.
"""

from __future__ import annotations

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.eval_bounds import eval_problem
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport
from dynabatch.scheduler.report_bounds import check_eval_version
from dynabatch.scheduler.saved_progress import SavedProgress


class Evaluations:
    """Evaluations: the one kept, when it was taken, and whether the final model has been evaluated."""

    def __init__(self) -> None:
        self.eval: EvalReport | None = None
        self.eval_time = 0.0  # job time when the kept evaluation arrived
        self.eval_model_time = 0.0  # job time when the model it evaluated existed (version_times.py)
        self.final_eval = False
        self.eval_rollbacks = 0  # the last rollback done when the evaluation kept was taken

    @staticmethod
    def check(report: EvalReport, newest_possible_version: int) -> None:
        """Refuse an evaluation whose figures cannot be, or of a version no shard can have reached yet."""
        problem = eval_problem(report)
        if problem:
            raise ProtocolError(ErrorCode.BAD_FIELD, problem)
        check_eval_version(report, newest_possible_version)

    def keep(
        self,
        report: EvalReport,
        t: float,
        newest_shard_version: int,
        rollback_done: int,
        stopping: bool,
        model_t: float | None = None,
    ) -> None:
        """Keep `report` if it is the newest, the final one, or the first of a model restored by a rollback
        (`rollback_done`, once every shard restored its checkpoint); `t` is the job's time, `model_t` when the
        model it evaluated existed (`t` when unknown)."""
        held = report.version <= newest_shard_version
        restored = held and self.eval_rollbacks < rollback_done
        if self.eval is None or report.version >= self.eval.version or report.final or restored:
            self.eval = report
            self.eval_time, self.eval_model_time = t, t if model_t is None else model_t
            if held:
                self.eval_rollbacks = rollback_done
        if report.final and stopping:
            self.final_eval = True

    def restore(self, saved: SavedProgress) -> None:
        """A saved job's evaluation (its rollbacks all applied when it was saved)."""
        self.eval, self.eval_time, self.final_eval = saved.eval, saved.eval_time, saved.final_eval
        self.eval_model_time = saved.eval_time if saved.eval_model_time is None else saved.eval_model_time
        self.eval_rollbacks = len(saved.rollbacks)
