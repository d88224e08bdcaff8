"""The worker loops by name: what a ProtocolSpec's `worker_loop` picks (each runs the planner of that name,
step_plans.py `PLANS`)."""

from __future__ import annotations

from collections.abc import Callable

from dynabatch.worker.gradient_steps import GradientLoop
from dynabatch.worker.local_steps import LocalRoundLoop, MsdLoop
from dynabatch.worker.step_context import StepContext, StepLoop

# Each makes its loop from the worker's step context.
LOOPS: dict[str, Callable[[StepContext], StepLoop]] = {
    loop.NAME: loop for loop in (GradientLoop, LocalRoundLoop, MsdLoop)
}
