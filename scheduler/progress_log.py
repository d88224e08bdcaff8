"""The scheduler's progress line: every `--log-every-s` of the job, its epoch, speed and loss in the log.

An operator who started the roles by hand has only the scheduler's log to see
whether the job trains (`kubectl logs statefulset/scheduler`): the line says how
far the job is, how fast it went since the last line, and with how many workers.
"""

from __future__ import annotations

import math


class ProgressLog:
    """When the next progress line is due, and what the last one counted (the speed is the difference)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s  # 0: no progress lines
        self._at: float | None = None
        self._samples = 0

    def line(self, now: float, samples: int, epoch: float, target_epochs: float, workers: int, loss: float) -> str:
        """The progress line if one is due at `now` (the first only once samples were trained), else ""."""
        if self.every_s <= 0 or samples == 0 or (self._at is not None and now - self._at < self.every_s):
            return ""
        rate = "" if self._at is None else f", {(samples - self._samples) / (now - self._at):.0f} samples/s"
        self._at, self._samples = now, samples
        shown_loss = f", loss {loss:.4f}" if math.isfinite(loss) else ""
        return f"epoch {epoch:.2f}/{target_epochs:g} ({samples} samples{rate}), {workers} worker(s) live{shown_loss}"
