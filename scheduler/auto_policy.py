"""`--batch-policy auto`: the batch policy chosen from the cluster the scheduler has measured.

The regime study (bench/RESULTS.md sections 11 and 14) found no configuration within 1.05x of the best in every
regime: which policy wins depends on the cluster (per-worker sizing wins for round protocols on mixed devices,
loses for asgd there), so the scheduler chooses it by the predictor's rule (common/planning/auto_choice.py `choose`),
restricted to the job's protocol, which the shards fixed at the start.

Until every ready worker has reported MEASURED_STEPS steps, auto splits as `fixed` does (a worker's prior speed
is its start-up probe, not a step); a worker that joins later is measured under the policy last chosen. Then it
builds the predictor's cluster from each worker's fitted step model (its transfers are in the fixed cost, so no
link is added) and its cap, and chooses; the choice is revisited when the cluster changes: a worker joins or
leaves, or a worker's predicted step at its share moves by SHIFT since the last choice. `choose` keeps the running
policy unless another is predicted HYSTERESIS faster, so noise does not flip it. A protocol the predictor does not
model runs `fixed` and says so, as does a job with a robust `--aggregation` (trimmed mean, median): it defends a
round by the honest majority of every worker's gradient, which a split that leaves workers out would thin.

The step models come from `SpeedModel.overhead_fit`: under a fixed split a worker's batch never varies, so the
step fit cannot tell a device's fixed compute cost from its per-sample cost; what it can see from the first step
is the time not spent computing (pulls, pushes), which is counted as fixed. A fixed compute cost (a GPU's kernel
launches, `--slowdowns F:A`'s A) is seen once the batch has varied, i.e. after auto chose `dynamic`.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynabatch.common.planning.auto_choice import choose
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.prediction import PROTOCOLS as MODELLED
from dynabatch.common.planning.prediction import Cluster, Node
from dynabatch.common.protocols import ProtocolSpec
from dynabatch.scheduler.speed_model import StepModel

AUTO = "auto"
MEASURED_STEPS = 8
"""Steps a worker must have reported to count as measured: its first ones carry its start-up (lazy
initialisation, caches, the other processes starting beside it), and with the speed model's forgetting of 0.85
the eighth step weighs three times the first."""
SHIFT = 0.25
"""How far (a fraction) a worker's predicted step at its share must move since the last choice for auto to choose
again: a speed shift, not the step-to-step noise of a loaded machine."""


def measured_cluster(models: Mapping[str, StepModel], caps: Mapping[str, int], global_batch: int) -> Cluster:
    """The predictor's cluster of the measured workers: each its fitted step curve and cap (0: none), no link
    (the fitted fixed cost holds its transfers), at the job's global batch; in worker id order."""
    return Cluster(
        tuple(Node(Device(models[w].fixed_s, models[w].per_sample_s, caps.get(w, 0))) for w in sorted(models)),
        global_batch,
    )


class AutoPolicy:
    """The policy auto runs now, why, and the measurements it was chosen on."""

    def __init__(self, spec: ProtocolSpec, global_batch: int, aggregation: str = "mean") -> None:
        self.protocol = spec.name
        self.global_batch = global_batch
        self.policy = "fixed"
        if aggregation != "mean":
            self.modelled = False
            self.reason = (
                f"fixed, as --aggregation {aggregation} needs every worker's gradient in each round: dynamic's "
                "split may leave the slowest out with batch 0, and a median over fewer honest workers is one a "
                "liar moves further"
            )
        else:
            self.modelled = spec.name in MODELLED
            self.reason = (
                f"fixed until every worker has reported {MEASURED_STEPS} steps"
                if self.modelled
                else f"fixed, as protocol {spec.name} is not modelled by the predictor (it models "
                f"{', '.join(MODELLED)})"
            )
        self.choices = 0  # how many times auto has chosen (kept or changed) from measurements
        self._basis: dict[str, float] = {}  # each worker's predicted step at its share when auto last chose

    def revisit(self, models: Mapping[str, StepModel], caps: Mapping[str, int], waiting: int) -> bool:
        """Choose again if the cluster changed since the last choice; `models` are the measured workers' step
        models, `caps` their largest batches, `waiting` the ready workers not yet measured. True when the policy
        changed."""
        if not self.modelled:
            return False
        if waiting or not models:
            kept = "fixed" if self.choices == 0 else f"{self.policy} as last chosen"
            self.reason = (
                f"{kept} until every worker has reported {MEASURED_STEPS} steps ({len(models)} of "
                f"{len(models) + waiting} measured)"
            )
            return False
        share = max(1, self.global_batch // len(models))
        steps = {w: m.step_seconds(share) for w, m in models.items()}
        if not self._changed(steps):
            return False
        self._basis = steps
        choice = choose(
            measured_cluster(models, caps, self.global_batch),
            STUDY_NOISE,
            current=(self.protocol, self.policy),
            protocols=(self.protocol,),
        )
        self.choices += 1
        previous, self.policy = self.policy, choice.policy
        self.reason = f"{choice.reason} (measured workers: {len(models)})"
        return self.policy != previous

    def _changed(self, steps: Mapping[str, float]) -> bool:
        """Whether the workers differ from the last choice's, or one's step at its share moved by SHIFT."""
        basis = self._basis
        if steps.keys() != basis.keys():
            return True
        return any(abs(steps[w] - basis[w]) > SHIFT * basis[w] for w in steps)
