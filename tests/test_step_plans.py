"""The worker's step planners (worker/step_plans.py), step by step, and that the simulator runs them instead of a
loop of its own."""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from dynabatch.common.protocols import DELTA, GRADIENT, SPECS
from dynabatch.ps.protocol_rules import RULES, one_per_round
from dynabatch.worker.loops import LOOPS
from dynabatch.worker.step_plans import (
    PLANS,
    Ack,
    Advance,
    Compute,
    GradientPlan,
    LocalPlan,
    MsdPlan,
    Pull,
    Pulled,
    Push,
    Step,
    StepPlan,
    plan_for,
)

ROOT = Path(__file__).resolve().parent.parent
ACTIONS = {"Pull", "Compute", "Push", "Advance"}
# What the planners read of a protocol's spec: nothing else in worker/ or bench/ may read it (the worker picks its
# loop by the spec's `worker_loop`, the name of the planner that loop runs).
PLANNER_FACTS = {"one_push_per_round", "held_pull_waits"}


@dataclass
class Orders:
    batch: int = 32
    local_steps: int = 1


def run(step: Step, outcomes: list[object]) -> tuple[list[object], bool]:
    """Drive `step` with one outcome per action after the first: (its actions, what it returned)."""
    actions: list[object] = [next(step)]
    for outcome in outcomes:
        try:
            actions.append(step.send(outcome))
        except StopIteration as over:
            return actions, bool(over.value)
    raise AssertionError(f"the step planned more than {len(actions)} actions: {actions}")


def test_an_asynchronous_step_pulls_whatever_is_there_computes_and_pushes_its_batch() -> None:
    plan = plan_for(SPECS["asgd"])
    actions, trained = run(plan.step(Orders(batch=24)), [Pulled([3, 5], 3), True, None])
    assert actions == [Pull(None, waits=False), Compute(24), Push(GRADIENT, 24)] and trained
    assert isinstance(plan, GradientPlan) and plan.min_versions is None


def test_a_round_step_waits_next_for_its_rounds_versions_and_goes_on_while_the_scheduler_gives_it_batches() -> None:
    plan = plan_for(SPECS["ssgd"])
    assert isinstance(plan, GradientPlan)
    actions, _ = run(plan.step(Orders()), [Pulled([2, 3], 2), True, None])
    assert actions[2] == Push(GRADIENT, 32, then_pull=[3, 4]), "a push may bring the next round's model back"
    assert next(plan.step(Orders())) == Pull([3, 4], waits=True)
    actions, trained = run(plan.step(Orders()), [Pulled([3, 4], 3), True, None])
    assert actions == [Pull([3, 4], waits=True), Compute(32), Push(GRADIENT, 32, then_pull=[4, 5])] and trained, (
        "no round count ends it: the scheduler's allotment does (common/allotment.py)"
    )


def test_after_a_failure_a_round_step_waits_for_its_round_only_if_it_was_already_in_it() -> None:
    plan = plan_for(SPECS["ssgd"])
    assert isinstance(plan, GradientPlan)
    run(plan.step(Orders()), [Pulled([7], 7), True, None])
    plan.after_failure("bad_state")
    assert plan.min_versions == [8]
    plan.after_failure("timeout")
    assert plan.min_versions is None


def test_a_step_whose_loss_is_not_finite_pushes_nothing_and_changes_no_round() -> None:
    plan = plan_for(SPECS["ssgd"])
    assert isinstance(plan, GradientPlan)
    actions, trained = run(plan.step(Orders()), [Pulled([7], 7), False])
    assert actions == [Pull(None, waits=False), Compute(32)] and not trained and plan.min_versions is None


def test_rennalas_held_pull_is_waiting_though_it_names_no_version() -> None:
    assert next(plan_for(SPECS["rennala"]).step(Orders())) == Pull(None, waits=True)


def test_a_local_round_takes_h_steps_pushes_their_samples_and_next_waits_for_the_rounds_it_entered() -> None:
    plan = plan_for(SPECS["local"])
    actions, trained = run(
        plan.step(Orders(batch=16, local_steps=4)), [Pulled([0, 0], 0), True, [Ack(True, 5), Ack(False, 7)]]
    )
    assert actions == [Pull(None, waits=True), Compute(16, steps=4), Push(DELTA, 64)] and trained
    assert next(plan.step(Orders(local_steps=0))) == Pull([5, 8], waits=True), "applied: 5; still open: 7 + 1"
    plan.after_failure("timeout")
    assert next(plan.step(Orders())) == Pull(None, waits=True)


def test_msd_steps_on_pushes_every_h_steps_with_one_delta_in_flight_and_reads_h_when_it_decides() -> None:
    plan = plan_for(SPECS["msd"])
    orders = Orders(batch=8, local_steps=2)
    actions, _ = run(plan.step(orders), [Pulled([0], 0), True])
    assert actions == [Pull(None, waits=False), Compute(8)], "the first step syncs; one step is not yet H"
    actions, _ = run(plan.step(orders), [True, None])
    assert actions == [Compute(8), Push(DELTA, 16, in_flight=True)]
    for _ in range(2):  # the average is not back yet: no second delta, however many steps
        actions, _ = run(plan.step(orders), [True, False])
        assert actions == [Compute(8), Advance()]
    orders.local_steps = 5  # AdaComm's H changed during the step: the plan reads it when it decides to push
    actions, _ = run(plan.step(orders), [True, True])
    assert actions == [Compute(8), Advance()], "back, but 3 steps since the push are fewer than H = 5"
    orders.local_steps = 3
    actions, _ = run(plan.step(orders), [True, None])
    assert actions == [Compute(8), Push(DELTA, 32, in_flight=True)]
    plan.after_failure("timeout")
    assert next(plan.step(orders)) == Pull(None, waits=False), "after a failure it syncs again, nothing in flight"
    assert isinstance(plan, MsdPlan) and not plan.in_flight


def test_a_delta_plan_entered_on_a_switch_starts_once_from_the_model_the_worker_holds() -> None:
    """`--protocol auto` switching a shard-bound job to local SGD: every worker's pull after the switch would queue
    at the shard, and a delta is the worker's progress from whatever model it starts on, so its first sync takes the
    model the worker holds; a gradient plan pulls (a gradient on it would be too stale for a round's rule)."""
    local = plan_for(SPECS["local"])
    assert local.start_held()
    actions, _ = run(local.step(Orders(batch=16, local_steps=2)), [Pulled([3], 3), True, [Ack(True, 7)]])
    assert actions == [Pull(None, waits=True, held=True), Compute(16, steps=2), Push(DELTA, 32)]
    assert next(local.step(Orders())) == Pull([7], waits=True), "once: the next round syncs onto the average"
    assert not local.start_held(), "a plan inside its rounds waits for the average"
    local.after_failure("timeout")
    assert local.start_held()
    local.after_failure("timeout")
    assert next(local.step(Orders())) == Pull(None, waits=True), "a failure drops the held start"
    msd = plan_for(SPECS["msd"])
    assert msd.start_held() and next(msd.step(Orders())) == Pull(None, waits=False, held=True)
    for name in ("asgd", "ssgd"):
        gradient = plan_for(SPECS[name])
        assert not gradient.start_held() and next(gradient.step(Orders())) == Pull(None, waits=False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_protocol_has_a_planner_and_a_worker_loop_of_one_name(name: str) -> None:
    spec = SPECS[name]
    assert isinstance(plan_for(spec), StepPlan)
    assert set(PLANS) == set(LOOPS)
    assert isinstance(plan_for(spec), {"gradient": GradientPlan, "local": LocalPlan, "msd": MsdPlan}[spec.worker_loop])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_shards_one_push_per_round_is_the_specs(name: str) -> None:
    assert SPECS[name].one_push_per_round == RULES[SPECS[name].shard_rule].ONE_PER_ROUND


def test_specs_that_share_a_shard_rule_must_agree_on_one_push_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SPECS, "ssgd2", replace(SPECS["ssgd"], name="ssgd2", one_push_per_round=False))
    with pytest.raises(ValueError, match="disagree"):
        one_per_round("round")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_simulator_runs_the_planners_and_plans_no_step_of_its_own() -> None:
    """bench/simulate.py takes its plans from worker/step_plans.py, constructs no action, names no planner class
    (no step or report of its own per protocol), and neither it nor any other file of bench/ or worker/ outside
    the planners reads what a planner reads of a protocol's spec."""
    sim = _tree(ROOT / "bench" / "simulate.py")
    imported = {
        alias.name
        for node in ast.walk(sim)
        if isinstance(node, ast.ImportFrom) and node.module == "dynabatch.worker.step_plans"
        for alias in node.names
    }
    assert "plan_for" in imported
    built = {node.func.id for node in ast.walk(sim) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not built & ACTIONS, "the simulator executes actions, it does not plan them"
    named = {node.id for node in ast.walk(sim) if isinstance(node, ast.Name)} | imported
    assert not named & {plan.__name__ for plan in PLANS.values()}, "nor does it tell one protocol's plan from another"
    for path in sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("worker/*.py")]):
        if path.name == "step_plans.py":
            continue
        read = {node.attr for node in ast.walk(_tree(path)) if isinstance(node, ast.Attribute)}
        assert not read & PLANNER_FACTS, f"{path.name} reads {read & PLANNER_FACTS}: the planner's to read"
