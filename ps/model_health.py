"""The shard's verdict on the model it holds, as it exports and logs it (param_guard.py judges the parameters).

The verdict is looked at after every update and every restore: a model that turns
sick is logged once, with the version of the last good checkpoint (no checkpoint
is written until it is healthy again, good_checkpoint.py), and one that recovers
is logged once; the parameter norm and the verdict are exported on every look.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dynabatch.ps.param_guard import ParamGuard
from dynabatch.ps.shard_metrics import ShardMetrics
from dynabatch.ps.shard_state import ShardState

log = logging.getLogger("dynabatch.ps")


class ModelHealth:
    """The guard over the model's parameters and its last verdict (`healthy`), exported on `metrics`."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self.metrics = metrics
        self.guard = ParamGuard()
        self.healthy = True

    @property
    def problem(self) -> str:
        """What is wrong with the model held (empty: nothing)."""
        return self.guard.problem

    def judge_afresh(self, model: ShardState, good_version: int) -> bool:
        """Judge a model just made or restored from a checkpoint; True if it is healthy."""
        self._watch(self.guard.reset(model.params), model.version, good_version)
        return not self.guard.problem

    def updated(self, cids: Iterable[int], model: ShardState, good_version: int) -> None:
        """Chunks `cids` (at least one) of `model` were just updated."""
        problem = ""
        for cid in cids:
            problem = self.guard.updated(cid, model.params)
        self._watch(problem, model.version, good_version)

    def _watch(self, problem: str, version: int, good_version: int) -> None:
        """Export the guard's view; log when the model turns sick or healthy again."""
        norm, was_healthy, self.healthy = self.guard.norm, self.healthy, not problem
        self.metrics.param_norm.set(norm)
        self.metrics.model_healthy.set(1.0 if self.healthy else 0.0)
        if problem and was_healthy:
            log.error(
                "model diverged at version %d: %s; no checkpoint is written until it is healthy again "
                "(the last good one is version %d), and the scheduler is told",
                version,
                problem,
                good_version,
            )
        elif not problem and not was_healthy:
            log.info("model healthy again at version %d (parameter norm %.3g)", version, norm)
