"""The job's base learning rate: its `--lr`, or, where that is 0 (the default), the step tuned for the step rule
that runs.

One `--lr` cannot serve both step rules. Under asgd's constant step every gradient moves the model by lr, and the
n gradients that land while one is computed move it n times that; under the delay step (lr / max(1, tau)), which
`--protocol auto` runs on every protocol it switches among (common/planning/protocol_switch.py `running`), they move
it about lr between them, as one round of ssgd or of local SGD does. So the tuned steps differ: on the main job asgd's
constant step is tuned at 0.05, auto's at DELAY_STEP_LR (bench/RESULTS.md 29, with the job's momentum 0.5; the
simulator's study tuned 0.2 to 0.4 with momentum 0, which takes half the step of 0.5 at the same lr). A user who names
no `--lr` gets the one tuned for the rule that runs.

The default is one value for every protocol auto may switch to, not one per protocol: the delay step exists so that
one step per B samples carries over between them (the study's tuned steps under it were within 1.25x of each other),
and one value needs nothing re-set on the shards' optimizers or the workers' inner steps at a switch.

A task that names its own optimizer owns the shards' step (ps/update_rules.optimizer_spec), whatever this says.
Every role resolves the job it runs (a shard its WELCOME's, a worker its own, the simulator its own) by this one
function, so the job on the wire keeps `lr` 0 and a flag left at its default still reads as not given
(common/config.check_flags_against_task).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynabatch.common.planning.protocol_switch import switches

if TYPE_CHECKING:
    from dynabatch.common.config import JobConfig

CONSTANT_STEP_LR = 0.05
"""The default step under a constant step (asgd's, and every protocol named without `--staleness-step delay`)."""
DELAY_STEP_LR = 0.1
"""The default step under the delay step: `--protocol auto`'s, tuned on the main job (bench/RESULTS.md 29)."""


def base_lr(job: JobConfig) -> float:
    """The base learning rate `job` runs at: its `--lr` if given (above 0), else DELAY_STEP_LR where it runs the
    delay step (`--protocol auto` choosing at run time, or `--staleness-step delay`), else CONSTANT_STEP_LR. An
    unresolved auto job and the job it runs under each protocol (`running`) resolve alike."""
    if job.lr > 0.0:
        return job.lr
    return DELAY_STEP_LR if switches(job) or job.staleness_step == "delay" else CONSTANT_STEP_LR
