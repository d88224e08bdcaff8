"""`--protocol auto` / `--batch-policy auto`'s rule: the method the predictor (common/planning/prediction.py) says
reaches the target first on the measured cluster, with the reason in words, and kept while it stays close.

A choice is revisited when the cluster changes (a join, a leave, a speed shift); HYSTERESIS keeps the running
method unless another is predicted that much faster, so that measurement noise does not flip a job between
methods. The protocol is fixed at a job's start (the shards take their rule from it), so only the policy can
follow a revisit live (`choose` with `protocols` of the running one alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynabatch.common.planning.optimum import NoiseScale
from dynabatch.common.planning.prediction import PROTOCOLS, Cluster, Prediction, optimum, predict_all
from dynabatch.common.planning.protocol_models import MODELS

HYSTERESIS = 0.10
"""A running method is replaced only by one predicted at least this fraction faster."""
EARLY_MARGINS: tuple[tuple[int, float], ...] = ((0, 2.0), (1, 2.0), (2, 0.5))
"""The hysteresis of a choice made before every worker is measured, by the fewest steps any worker has reported:
(steps, hysteresis), fewest first. Before a worker's first step (0) the choice rests on every worker's start-up
probe and first push (an upper bound on its link) and the shards' own service time: a method predicted three times
faster on those.
A worker's first step carries its start-up and its wait behind the others' first pulls, so a choice on it alone
takes a method predicted three times faster too; from the second, which gives the pace, 1.5x. Where a step is long
(a shard serving 64 workers: ten seconds) each step waited for under the running method costs more than most of
what choosing well gains (bench/RESULTS.md 35, 40, 50)."""


@dataclass(frozen=True)
class Choice:
    """The method chosen, why, and the prediction it rests on."""

    protocol: str
    policy: str
    reason: str
    prediction: Prediction


def choice_of(reason: str) -> str:
    """The choice a reason names: the part before its first colon. A choice kept on a revisit, or held while new
    workers are measured, is named the same way as when it was made, with new figures after the colon; so a
    reader that shows a line per choice (the console of `dynabatch run`) shows one only when this changes."""
    return reason.split(":", 1)[0]


def choosable(p: Prediction) -> bool:
    """Whether `choose` may pick the method: any but a dynamic split the scheduler does not make as predicted."""
    return p.policy != "dynamic" or MODELS[p.protocol].split_as_predicted


def early_hysteresis(steps: int) -> float:
    """The hysteresis of a choice on workers the fewest of which has reported `steps` steps (0: on their probes and
    first pushes), not all measured (EARLY_MARGINS)."""
    if steps < 0:
        raise ValueError(f"early_hysteresis: {steps} steps")
    return [margin for least, margin in EARLY_MARGINS if steps >= least][-1]


def _name(p: Prediction) -> str:
    return f"{p.protocol} + {p.policy}"


def choose(
    cluster: Cluster,
    noise: NoiseScale,
    current: tuple[str, str] | None = None,
    protocols: Sequence[str] = tuple(PROTOCOLS),
    policies: Sequence[str] | None = None,
    hysteresis: float = HYSTERESIS,
) -> Choice:
    """The method among `protocols` (x every policy, or those of `policies`) predicted fastest to target on
    `cluster`; `current` (the running protocol and policy) is kept unless the best is predicted `hysteresis`
    faster (HYSTERESIS; more where the cluster is measured on few steps).
    A dynamic split the scheduler does not make as predicted (`ProtocolModel.split_as_predicted`) is never chosen."""
    predicted = predict_all(cluster, noise, protocols)
    ranked = [p for p in predicted if choosable(p) and (policies is None or p.policy in policies)]
    if not ranked:
        raise ValueError(f"choose: none of {list(protocols)} is modelled (modelled: {', '.join(PROTOCOLS)})")
    best, star = ranked[0], optimum(cluster, noise).time_s
    held = next((p for p in ranked if (p.protocol, p.policy) == current), None)
    if held is not None and held is not best and held.time_s <= best.time_s * (1 + hysteresis):
        return Choice(
            held.protocol,
            held.policy,
            f"{_name(held)}: kept, predicted {held.time_s:.3g} s ({held.time_s / star:.2f}x T*), within "
            f"{hysteresis:.0%} of the fastest, {_name(best)} ({best.time_s:.3g} s)",
            held,
        )
    runner = f"; next {_name(ranked[1])}, {ranked[1].time_s / best.time_s:.2f}x slower" if len(ranked) > 1 else ""
    runner += "".join(
        f"; {_name(p)} ({p.time_s:.3g} s) not chosen: the scheduler's dynamic split is not the predicted one"
        for p in predicted
        if not choosable(p) and p.time_s < best.time_s
    )
    return Choice(
        best.protocol,
        best.policy,
        f"{_name(best)}: predicted fastest to target, {best.time_s:.3g} s ({best.time_s / star:.2f}x T* = "
        f"{star:.3g} s) at {best.samples_per_s:,.0f} samples/s{runner}",
        best,
    )
