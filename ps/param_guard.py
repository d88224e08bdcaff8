"""A shard's watch over its own parameters: is the model it holds still a model?

Pushed gradients are checked for finiteness on arrival (common/wire/frames.py), but a
model can blow up from finite gradients (a step size too large, a gradient that
is finite but huge): its parameters grow without bound, overflow, and turn NaN.
Every worker then computes a NaN loss and skips its step, and a shard that did
not look at its own parameters would checkpoint the wrecked model every interval.

The guard keeps the norm of each chunk, recomputed when the chunk is updated
(one pass over the chunk, beside the several passes of the update itself), and
the model's norm from them. The model is sick when that norm is not finite (a
parameter overflowed or is NaN), or when it is more than `EXPLODE_FACTOR` times
its running level: an exponential average of the norm over healthy updates,
which follows the slow growth of honest training but not a blow-up. The level
is taken as at least `FLOOR_RMS` per parameter, so a model that starts at zeros
may grow to that size without being called exploding. A shard
checkpoints only a healthy model, and reports what the guard sees to the
scheduler, which rolls the job back (scheduler/divergence.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

EXPLODE_FACTOR = 10.0  # a model norm this many times its running level is a blow-up, not training
LEVEL_WEIGHT = 0.01  # weight of one healthy update in the running level (a time constant of 100 updates)
FLOOR_RMS = 0.01  # the running level is at least this root-mean-square per parameter


class ParamGuard:
    """Chunk norms, the model's norm, its running level, and what is wrong with them (empty: nothing)."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}
        self.level = math.nan
        self.floor = 0.0
        self.problem = ""

    @property
    def norm(self) -> float:
        """The whole model's (this shard's part's) Euclidean norm; inf or NaN if a chunk's is."""
        return math.sqrt(sum(n * n for n in self.norms.values()))

    def reset(self, params: Mapping[int, torch.Tensor]) -> str:
        """Judge a model afresh (at its start, or restored from a checkpoint); returns the problem, if any.

        The running level starts at this model's norm: a restored model is the
        reference its own training goes on from.
        """
        self.norms = {cid: _norm(t) for cid, t in params.items()}
        self.floor = FLOOR_RMS * math.sqrt(sum(t.numel() for t in params.values()))
        self.level = self.norm if math.isfinite(self.norm) else math.nan
        return self._judge(params)

    def updated(self, cid: int, params: Mapping[int, torch.Tensor]) -> str:
        """Chunk `cid` of `params` was just updated; returns the model's problem, if any."""
        self.norms[cid] = _norm(params[cid])
        return self._judge(params)

    def _judge(self, params: Mapping[int, torch.Tensor]) -> str:
        norm = self.norm
        if not math.isfinite(norm):
            bad = [cid for cid, n in self.norms.items() if not math.isfinite(n)]
            broken = [cid for cid in bad if not bool(torch.isfinite(params[cid]).all())]
            self.problem = (
                f"parameters not finite (NaN or inf) in chunk(s) {broken[:5]}"
                if broken
                else f"parameter norm overflows float32 in chunk(s) {bad[:5]}"
            )
        elif math.isfinite(self.level) and norm > EXPLODE_FACTOR * max(self.level, self.floor):
            ref = max(self.level, self.floor)
            self.problem = f"parameter norm {norm:.3g} is {norm / ref:.3g}x its running level {ref:.3g}"
        else:
            self.problem = ""
            self.level = norm if not math.isfinite(self.level) else self.level + LEVEL_WEIGHT * (norm - self.level)
        return self.problem


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))
