"""The worker loops by name: what a ProtocolSpec's `worker_loop` picks."""

from __future__ import annotations

from dynabatch.worker.gradient_steps import GradientLoop, RoundLoop, SampleRoundLoop
from dynabatch.worker.local_steps import LocalRoundLoop, MsdLoop
from dynabatch.worker.step_context import StepLoop

LOOPS: dict[str, type[StepLoop]] = {
    loop.NAME: loop for loop in (GradientLoop, RoundLoop, SampleRoundLoop, LocalRoundLoop, MsdLoop)
}
