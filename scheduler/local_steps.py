"""How many local steps H a worker takes between syncs (the `local` and `msd` protocols).

`local` uses the configured H throughout. `msd` follows AdaComm (Wang & Joshi,
2019): H = ceil(H0 * sqrt(loss / loss0)), so workers communicate rarely while
the loss is high and more often as it falls, which is when averaging helps
most. H never drops below ceil(sync seconds / compute seconds per step):
with fewer local steps than that, the averaged model could not come back
before the next push is due and communication would no longer be hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalStepsDecision:
    steps: int
    reason: str


def adacomm_steps(h0: int, loss0: float, loss: float, sync_s: float, compute_s: float) -> LocalStepsDecision:
    """H for the current loss, bounded below by the communication/computation ratio."""
    if not (math.isfinite(loss0) and math.isfinite(loss)) or loss0 <= 0:
        return LocalStepsDecision(h0, "no loss yet: H0")
    ratio = max(0.0, loss / loss0)
    by_loss = max(1, min(h0, math.ceil(h0 * math.sqrt(ratio))))
    floor = math.ceil(sync_s / compute_s) if compute_s > 0 and sync_s > 0 else 1
    steps = max(by_loss, floor)
    reason = f"loss/loss0 {ratio:.2f} gives {by_loss}"
    if floor > by_loss:
        reason += f"; sync/compute {sync_s / compute_s:.1f} needs at least {floor} to hide communication"
    return LocalStepsDecision(steps, reason)
