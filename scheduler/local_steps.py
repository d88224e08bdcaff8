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


def adacomm_steps(
    h0: int, current: int, loss0: float, loss: float, sync_s: float, compute_s: float
) -> LocalStepsDecision:
    """H for the current loss: never above H0 or the current H (AdaComm only shrinks it, which
    also keeps a noisy loss from flapping it), never below the communication/computation ratio.

    The ratio is capped at H0: in msd the sync time includes waiting for the
    round, which grows with H, so an uncapped floor would feed on itself.
    """
    if not (math.isfinite(loss0) and math.isfinite(loss)) or loss0 <= 0:
        return LocalStepsDecision(current, "no loss yet")
    ratio = max(0.0, loss / loss0)
    by_loss = max(1, min(current, math.ceil(h0 * math.sqrt(ratio))))
    floor = min(h0, math.ceil(sync_s / compute_s)) if compute_s > 0 and sync_s > 0 else 1
    steps = max(by_loss, floor)
    reason = f"loss/loss0 {ratio:.2f} gives {by_loss}"
    if floor > by_loss:
        reason += f"; sync/compute {sync_s / compute_s:.1f} needs at least {floor} to hide communication"
    return LocalStepsDecision(steps, reason)
