"""`--batch-policy auto`: the batch policy chosen from the cluster the scheduler has measured.

The regime study (bench/RESULTS.md sections 11 and 14) found no configuration within 1.05x of the best in every
regime: which policy wins depends on the cluster (per-worker sizing wins for round protocols on mixed devices,
loses for asgd there), so the scheduler chooses it by the predictor's rule (common/planning/auto_choice.py `choose`),
restricted to the job's protocol, which the shards fixed at the start.

Until every ready worker is measured, auto splits as `fixed` does (a worker's prior speed is its start-up probe, not a
step). A worker is measured once it has reported MEASURED_STEPS steps, or, behind a slow link or on a slow device, once
its steps have lasted as long as the slowest of those took for theirs (`measured_workers`): a worker whose one step
takes a minute would otherwise hold the choice for eight. Where every worker's steps are long (a busy shard), auto may
choose once each has reported EARLY_STEPS, but only for a method predicted faster than the running one by the margin its
fewest steps call for; before any step, once the shards have reported the transfers they served and every worker's first
push, it may choose on the workers' start-up probes, those first pushes and the shards' service time, at the widest
margin (common/planning/auto_choice.py `early_hysteresis`), and chooses again as the steps reach the next margin's and
once all are measured. A worker that joins later is measured under the policy last chosen; after a protocol switch every
worker is measured anew (`SpeedModel.restart`). Then auto builds the predictor's cluster from each worker's compute
curve, cap and link and the shards' service time (scheduler/measured_cluster.py; where a worker reports no compute time,
from its fitted step model with its transfers in the fixed cost, `folded_cluster`), and chooses; the choice is revisited
when the cluster changes: a worker joins or leaves, or a worker's predicted step at its share moves by SHIFT since the
last choice. `choose` keeps the running policy unless another is predicted HYSTERESIS faster, so noise does not flip it.
A protocol the predictor does not model runs `fixed` and says so, as does a job with a robust `--aggregation` (trimmed
mean, median): it defends a round by the honest majority of every worker's gradient, which a split that leaves workers
out would thin.

Under `--protocol auto` (common/planning/protocol_switch.py) the same choice is made over the protocols the job
may switch among, the protocol and the policy together; the scheduler then switches the shards and, once they all
apply it, the workers (scheduler/protocol_in_force.py).

The step models come from `SpeedModel.overhead_fit`: under a fixed split a worker's batch never varies, so the
step fit cannot tell a device's fixed compute cost from its per-sample cost; what is known from the first step is
the time not spent computing (pulls, pushes) and the fixed compute cost (a GPU's kernel launches, `--slowdowns F:A`'s
A) that the worker's start-up probe of two batch sizes found, and both are counted as fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynabatch.common.planning.auto_choice import EARLY_MARGINS, HYSTERESIS, choose, early_hysteresis
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.prediction import POLICIES, Cluster, Node
from dynabatch.common.planning.prediction import PROTOCOLS as MODELLED
from dynabatch.common.protocols import ProtocolSpec
from dynabatch.scheduler.speed_model import StepModel

AUTO = "auto"
MEASURED_STEPS = 8
"""Steps a worker must have reported to count as measured: its first ones carry its start-up (lazy
initialisation, caches, the other processes starting beside it), and with the speed model's forgetting of 0.85
the eighth step weighs three times the first."""
EARLY_STEPS = EARLY_MARGINS[1][0]
"""Steps every worker must have reported for auto to choose on their own steps before each has MEASURED_STEPS, at
EARLY_MARGINS' margin for them: a margin the noise of a few steps does not close. Before that, auto may choose
once on the workers' start-up probes and first pushes and the shards' own service time (EARLY_MARGINS' first, for
0 steps)."""
HELD = "; chosen again once"
"""How a reason says auto's last choice stands while a newly ready worker is measured, and is made again once it
is (bench/auto_unseen.py reads it: a run held so has chosen). It read "held until", which beside a switch seemed to
say the switch was held back."""
SHIFT = 0.25
"""How far (a fraction) a worker's predicted step at its share must move since the last choice for auto to choose
again: a speed shift, not the step-to-step noise of a loaded machine."""


def _basis(early: int, fewest: int, counted: str, workers: int) -> str:
    """What a choice rested on, in words: the probes and the shards (no step yet), every worker's first `fewest`
    steps, or the measured workers."""
    if not early:
        return f"measured workers: {workers}"
    if fewest == 0:
        return f"chosen on every worker's start-up probe and first push, and the shards' service time, {counted}"
    return f"chosen on every worker's first {'step' if fewest == 1 else f'{fewest} steps'} or more, {counted}"


def folded_cluster(
    models: Mapping[str, StepModel], caps: Mapping[str, int], global_batch: int, min_batch: int = 1
) -> Cluster:
    """The predictor's cluster of the measured workers: each its fitted step curve and cap (0: none), no link
    (the fitted fixed cost holds its transfers, which local SGD would then pay every step), at the job's global
    batch and least batch; in worker id order."""
    return Cluster(
        tuple(Node(Device(models[w].fixed_s, models[w].per_sample_s, caps.get(w, 0))) for w in sorted(models)),
        global_batch,
        min_batch=min_batch,
    )


def measured_workers(observed: Mapping[str, tuple[int, float]], steps: int = MEASURED_STEPS) -> list[str]:
    """The workers auto may choose on, of `observed` (each its steps reported and its step's seconds now): those
    with `steps` steps, and those with at least one whose steps have lasted as long as `steps` of the slowest of
    those (none has `steps`: none)."""
    full = [s * steps for n, s in observed.values() if n >= steps]
    if not full:
        return []
    span = max(full)
    return [w for w, (n, s) in observed.items() if n >= steps or (n >= 1 and n * s >= span)]


class AutoPolicy:
    """The policy (and, under `--protocol auto`, the protocol) auto runs now, why, and the measurements it was
    chosen on.

    `protocols` are those it may choose among (empty: the job's, `spec`, alone; `--protocol auto`: those
    common/planning/protocol_switch.py allows, the job starting on `spec`'s); `policy` is the job's batch policy:
    auto, or the one policy a `--protocol auto` job with a named policy keeps.
    """

    def __init__(
        self,
        spec: ProtocolSpec,
        global_batch: int,
        aggregation: str = "mean",
        protocols: Sequence[str] = (),
        policy: str = AUTO,
        min_batch: int = 1,
    ) -> None:
        self.protocol = spec.name
        self.protocols = tuple(p for p in (protocols or (spec.name,)) if p in MODELLED)
        self.policies = None if policy == AUTO else (policy,)
        self.global_batch, self.min_batch = global_batch, min_batch
        self.policy = "fixed" if policy == AUTO else policy
        if self.policies is not None and policy not in POLICIES:
            self.modelled = False
            self.reason = f"{spec.name} kept, as the predictor does not model --batch-policy {policy}"
        elif aggregation != "mean":
            self.modelled = False
            self.reason = (
                f"fixed, as --aggregation {aggregation} needs every worker's gradient in each round: dynamic's "
                "split may leave the slowest out with batch 0, and a median over fewer honest workers is one a "
                "liar moves further"
            )
        else:
            self.modelled = bool(self.protocols) and spec.name in self.protocols
            self.reason = (
                f"{self.policy} until every worker has reported {MEASURED_STEPS} steps"
                if self.modelled
                else f"fixed, as protocol {spec.name} is not modelled by the predictor (it models "
                f"{', '.join(MODELLED)})"
            )
        self.choices = 0  # how many times auto has chosen (kept or changed) from measurements
        self._chosen = ""  # the reason of the last choice, which a wait for new workers' steps keeps
        self._basis: dict[str, float] = {}  # each worker's predicted step at its share when auto last chose
        self._hysteresis = HYSTERESIS  # the margin auto last chose at: wider while it chose on a few steps

    def leave_out(self, protocol: str, running: str) -> None:
        """A shard cannot run `protocol`: choose among the others from the next revisit on, `running` meanwhile."""
        self.protocols = tuple(p for p in self.protocols if p in MODELLED and p != protocol)
        self.protocol, self._basis = running, {}
        self.reason = self._chosen = f"{running} + {self.policy}: {protocol} left out, a shard cannot run it"

    def revisit(
        self,
        models: Mapping[str, StepModel],
        caps: Mapping[str, int],
        waiting: int,
        measured: Cluster | None = None,
        early: int = 0,
        fewest: int = MEASURED_STEPS,
    ) -> bool:
        """Choose again if the cluster changed since the last choice; `models` are the measured workers' step
        models, `caps` their largest batches, `waiting` the ready workers not yet measured; `measured` the cluster
        with each worker's compute, link and the shards apart (scheduler/measured_cluster.py; None: the workers
        report no compute time, so `folded_cluster`'s steps with their transfers as fixed cost). `early`: how many
        of `models` have reported only EARLY_STEPS steps or more, not MEASURED_STEPS, and `fewest` the fewest steps
        of those; the running method then gives way only to one predicted faster by `early_hysteresis(fewest)`, and
        the choice is made again once the steps reach a narrower margin and once every worker is measured. With
        `fewest` 0, `models` are the start-up probes and `measured` holds the shards' service and each worker's first
        push bounding its link (AutoInputs._on_probes, scheduler/auto_inputs.py). True when the policy (or the
        protocol) changed."""
        if not self.modelled:
            return False
        if waiting or not models:
            self.reason = self._holding(f"{len(models)} of {len(models) + waiting} measured")
            return False
        share = max(1, self.global_batch // len(models))
        steps = {w: m.step_seconds(share) for w, m in models.items()}
        hysteresis = early_hysteresis(fewest) if early else HYSTERESIS
        if not self._changed(steps) and hysteresis == self._hysteresis:
            return False
        self._basis, self._hysteresis = steps, hysteresis
        choice = choose(
            measured or folded_cluster(models, caps, self.global_batch, self.min_batch),
            STUDY_NOISE,
            current=(self.protocol, self.policy),
            protocols=self.protocols,
            policies=self.policies,
            hysteresis=hysteresis,
        )
        counted = f"{len(models) - early} of {len(models)} measured"
        previous = (self.protocol, self.policy)
        if early and (choice.protocol, choice.policy) == previous:
            self.reason = self._holding(counted)  # a keep on a few steps is no choice: the measuring goes on
            return False
        self.choices += 1
        self.protocol, self.policy = choice.protocol, choice.policy
        self.reason = self._chosen = f"{choice.reason} ({_basis(early, fewest, counted, len(models))})"
        return (self.protocol, self.policy) != previous

    def _holding(self, counted: str) -> str:
        """The reason while auto waits for workers' steps (`counted`: how many are measured of how many)."""
        if self.choices == 0:
            return f"{self.policy} until every worker has reported {MEASURED_STEPS} steps: {counted}"
        return f"{self._chosen}{HELD} every worker has reported {MEASURED_STEPS} steps ({counted})"

    def _changed(self, steps: Mapping[str, float]) -> bool:
        """Whether the workers differ from the last choice's, or one's step at its share moved by SHIFT."""
        basis = self._basis
        if steps.keys() != basis.keys():
            return True
        return any(abs(steps[w] - basis[w]) > SHIFT * basis[w] for w in steps)
