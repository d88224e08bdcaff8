"""Workers idled because Ringmaster would discard every step they take, and the evidence the scheduler judges by.

The rule is common/planning/discarded_workers.py's, which the predictor shares: from each worker's step at the split
every worker would get and the threshold R, the workers whose delay always reaches R. The scheduler idles such a
worker only once its own reports agree: IDLE_AFTER steps in a row discarded, none applied since
(`WorkerHeartbeat.discarded` grows while `steps` does not). An idle worker is judged again at every reallocation on
its last measured speed (it takes no step, so no newer one exists), the others' speeds, R and the protocol that runs:
it comes back once its mean delay is at most R - 1 (a faster worker left, the others slowed down).
"""

from __future__ import annotations

from collections.abc import Mapping

from dynabatch.common.planning.discarded_workers import Discarded, delays

IDLE_AFTER = 3
"""Discarded steps in a row, none applied, before a worker the rule names is idled: a worker whose mean delay is
near R has some steps applied, and those reset the count."""


class IdleWorkers:
    """Who is idle and why, and each worker's discarded steps since its last applied one."""

    def __init__(self) -> None:
        self.idle: dict[str, Discarded] = {}
        self._last: dict[str, tuple[int, int]] = {}  # by worker: (steps, discarded) it last reported
        self._since: dict[str, int] = {}  # by worker: its discarded count when it last applied a step (or came back)

    def report(self, worker: str, steps: int, discarded: int) -> None:
        """`worker` reports `steps` applied and `discarded` steps discarded, both cumulative."""
        last = self._last.get(worker)
        if last is None or steps != last[0]:
            self._since[worker] = discarded
        self._last[worker] = (steps, discarded)

    def discarded_in_a_row(self, worker: str) -> int:
        """The steps `worker` had discarded since its last applied one."""
        last = self._last.get(worker)
        return 0 if last is None else last[1] - self._since.get(worker, last[1])

    def judge(self, steps_s: Mapping[str, float] | None, threshold: int) -> bool:
        """Idle the workers whose every step the rule says would be discarded at `steps_s` (worker -> its step seconds
        at everyone's split; None: the protocol that runs discards nothing for its delay) once their reports agree;
        keep idle those whose mean delay is still above R - 1. A worker that comes back counts its discarded steps
        anew.
        True when the idle workers changed."""
        judged = {} if steps_s is None else delays(steps_s, threshold)
        idle = {
            w: d
            for w, d in judged.items()
            if (w in self.idle and d.mean > threshold - 1) or (d.always and self.discarded_in_a_row(w) >= IDLE_AFTER)
        }
        for back in set(self.idle) - set(idle):
            self._since[back] = self._last.get(back, (0, 0))[1]
        changed = set(idle) != set(self.idle)
        self.idle = idle
        return changed

    def reason(self, worker: str) -> str:
        """Why `worker` is idle ("" when it is not)."""
        discarded = self.idle.get(worker)
        return "" if discarded is None else discarded.reason

    def forget(self, worker: str) -> None:
        """A worker that left."""
        for kept in (self.idle, self._last, self._since):
            kept.pop(worker, None)
