"""`--protocol auto` without a cluster file: the switch decided by the scheduler and taken by the shards, driven
directly (common/planning/protocol_switch.py, scheduler/protocol_in_force.py, ps/shard_state.py `switch`,
ps/push_admission.py); tests/test_protocol_switch_run.py runs it in a real job."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from dynabatch import optim as optim_spec
from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.protocol_switch import START, SWITCHABLE, switch_plan, workers_protocol
from dynabatch.common.protocols import AsyncSettings, OuterSettings, RoundSettings, protocol_settings
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ChunkMeta, Message
from dynabatch.common.wire.messages import (
    Hello,
    Push,
    Role,
    ShardHeartbeat,
    Welcome,
    WorkerAssignment,
    WorkerHeartbeat,
)
from dynabatch.common.wire.model_signature import signature_from_fields
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.ps.model_service import unrunnable
from dynabatch.ps.protocol_rules import RingmasterRule
from dynabatch.ps.push_admission import PushAdmission, PushCase
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ProtocolRefusal, ProtocolSwitched, ShardState
from dynabatch.ps.update_rules import OuterOptimizer
from dynabatch.scheduler.auto_policy import MEASURED_STEPS
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.outage_clock import read_clock
from dynabatch.scheduler.saved_progress import load_progress, save_progress
from dynabatch.worker.pipeline import Pipeline
from dynabatch.worker.ps_client import ShardClients
from harness import free_port

SGD = optim_spec.SGD(lr=0.1, momentum=0.9)
B = 64


def test_auto_may_switch_among_the_protocols_the_jobs_flags_allow() -> None:
    plan = switch_plan(JobConfig(protocol="auto"))
    assert plan.start == START and plan.protocols == SWITCHABLE and not plan.why_not
    # a pull before the worker's own push is asgd's alone: auto stays on it, and says why
    prefetch = switch_plan(JobConfig(protocol="auto", prefetch_pull=True))
    assert prefetch.protocols == (START,) and "--prefetch-pull" in prefetch.why_not
    # a robust aggregation needs rounds: auto starts on one and keeps it
    median = switch_plan(JobConfig(protocol="auto", aggregation="median"))
    assert median.protocols == (median.start,) and median.start != START and "--aggregation median" in median.why_not
    with pytest.raises(ConfigError, match="no protocol it chooses among takes this job"):
        switch_plan(JobConfig(protocol="auto", aggregation="median", prefetch_pull=True))


def test_workers_are_told_a_protocol_only_once_every_shard_applies_it() -> None:
    assert workers_protocol("ssgd", "asgd", {0: "ssgd"}, 2) == "asgd"
    assert workers_protocol("ssgd", "asgd", {0: "ssgd", 1: "asgd"}, 2) == "asgd"
    assert workers_protocol("ssgd", "asgd", {0: "ssgd", 1: "ssgd"}, 2) == "ssgd"
    assert workers_protocol("asgd", "asgd", {}, 2) == "asgd"


def _state(protocol: str) -> tuple[ShardState, torch.Tensor]:
    flat = torch.randn(600, generator=torch.Generator().manual_seed(5))
    state = ShardState.initial(make_layout(600, 1024, 1).chunks, flat, SGD, protocol, B, AsyncSettings())
    state.set_membership({"w0", "w1"}, allocated=2)
    return state, flat


def _push(state: ShardState, worker: str, g: torch.Tensor, samples: int = B // 2) -> list[int]:
    chunks = {c.id: g[c.start : c.stop] for c in state.chunks}
    base = {cid: state.chunk_versions[cid] for cid in chunks}
    return state.push(worker, chunks, base, samples, state.kind, 0.0).applied


def _flat(state: ShardState) -> torch.Tensor:
    return torch.cat([state.params[c.id] for c in state.chunks])


def test_a_shard_switches_its_rule_around_the_same_model_and_closes_its_open_round() -> None:
    state, _ = _state("asgd")
    g = torch.full((600,), 0.5)
    assert _push(state, "w0", g), "asgd applies on arrival"
    model, version, optimizers = _flat(state).clone(), state.version, dict(state.optim)
    assert state.switch("ssgd", RoundSettings()) == []
    assert torch.equal(_flat(state), model) and state.version == version and state.live == {"w0", "w1"}
    assert all(state.optim[cid] is opt for cid, opt in optimizers.items()), "gradient to gradient keeps momentum"
    assert _push(state, "w0", g) == [], "ssgd's round waits for w1"
    assert state.version == version
    closed = state.switch("local", OuterSettings())
    assert closed and state.version == version + 1, "the round w0 pushed into closes with what arrived"
    assert not torch.equal(_flat(state), model)
    assert all(isinstance(opt, OuterOptimizer) for opt in state.optim.values()), "local's outer optimizer, fresh"
    before = _flat(state).clone()
    _push(state, "w0", torch.full((600,), 0.1))
    assert _push(state, "w1", torch.full((600,), 0.1)), "a local round of both workers' deltas"
    assert torch.allclose(_flat(state), before - 0.1), "plain averaging: the mean delta"
    state.switch("asgd", AsyncSettings(staleness_step="delay"))
    assert not any(isinstance(opt, OuterOptimizer) for opt in state.optim.values())
    assert _push(state, "w1", g) and state.protocol == "asgd"
    with pytest.raises(ValueError, match="takes RoundSettings"):
        state.switch("ssgd", AsyncSettings())
    assert state.protocol == "asgd", "a refused switch changes nothing"


SIG = signature_from_fields(["w", "b"], [[30, 10], [10]], ["float32", "float32"], train_size=500)


def _served(
    tmp_path: Path, prefetch_pull: bool = False, registry: CollectorRegistry | None = None
) -> tuple[ServedJob, ShardState]:
    config = replace(
        JobConfig(), job="j", shards=1, chunk_bytes=1024, protocol="asgd", global_batch=B, prefetch_pull=prefetch_pull
    )
    served = ServedJob.welcomed(
        Welcome(id="ps0", config=to_dict(config), shards=[], shard_index=0),
        registry or CollectorRegistry(),
        str(tmp_path),
    )
    state = served.new_state(SIG, torch.ones(SIG.total), {}, {})
    state.set_membership({"w0", "w1"}, allocated=2)
    served.assigned.update({"w0": B // 2, "w1": B // 2})
    return served, state


def test_a_push_made_under_the_old_protocol_is_refused_switched_and_is_no_strike(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    served, state = _served(tmp_path, registry=registry)
    served.switch("ssgd")
    state.switch("ssgd", protocol_settings(served.job))
    admission = PushAdmission(ReplayGuard(), lambda identity: None, lambda: None)
    metas = [ChunkMeta(c.id, "float32", (c.length,), 0) for c in state.chunks]
    far = [torch.full((c.length,), 1e6) for c in state.chunks]  # a gradient the bound would clip and count
    case = PushCase(Message(Push(samples=B // 2, protocol="asgd"), metas, far, "j", "w0", 1), b"c0", served, state, 0)
    with pytest.raises(ProtocolSwitched) as refused:
        admission.admit(case)
    assert isinstance(refused.value, ProtocolRefusal) and refused.value.code == "switched"
    assert case.found is None and not served.bounds.history, "nothing was assessed: no strike against w0"
    assert state.protocol == "ssgd" and state.version == 0, "the push's claim changed nothing"
    admission.refused(case, refused.value)

    def discarded(reason: str) -> float | None:
        return registry.get_sample_value("dynabatch_ps_discarded_gradients_total", {"shard": "0", "reason": reason})

    assert (discarded("switched"), discarded("too_stale")) == (1.0, 0.0), "counted by its reason, apart from stale"
    # a worker that names a protocol it would like is refused the same way: only the scheduler sets one
    claim = PushCase(Message(Push(samples=B // 2, protocol="local"), metas, far, "j", "w0", 2), b"c0", served, state, 0)
    with pytest.raises(ProtocolSwitched):
        admission.admit(claim)
    assert state.protocol == "ssgd" and served.job.protocol == "ssgd"


def test_the_push_bounds_follow_the_protocol_and_a_refused_switch_changes_nothing(tmp_path: Path) -> None:
    served, _ = _served(tmp_path)
    gradient_bound = served.max_samples
    served.switch("local")
    assert served.assigned.steps == served.job.local_steps > 1
    assert served.max_samples == gradient_bound * served.job.local_steps, "a delta sums its H local steps"
    prefetching, _ = _served(tmp_path / "p", prefetch_pull=True)
    with pytest.raises(ConfigError, match="--prefetch-pull"):
        prefetching.switch("ssgd")
    assert prefetching.job.protocol == "asgd" and prefetching.assigned.steps == 1


def _auto_job(num_shards: int) -> JobState:
    job = JobConfig(
        protocol="auto", dataset="synthetic", model="mlp", global_batch=96, epochs=1.0, liveness_timeout_s=60.0
    )
    state = JobState(job, num_shards=num_shards, train_size=100_000, now=0.0)
    for s in range(num_shards):
        state.hello(Hello(role=Role.SHARD, endpoint=f"tcp://ps:{s}", shard_index=s), 0.0)
    return state


def _shards_report(state: JobState, now: float, protocols: dict[int, str] | None = None) -> None:
    """Every shard heartbeats having applied its assignment (and the protocol in `protocols`, else the one it was
    told)."""
    for index, shard in sorted(state.roster.shards.items()):
        told = state.shard_assignment()
        applied = (protocols or {}).get(index, told.protocol)
        hb = ShardHeartbeat(membership=told.membership, batches=told.batches, protocol=applied)
        state.shard_heartbeat(shard.id, hb, now)


def _measured(state: JobState) -> tuple[dict[str, float], float, WorkerAssignment]:
    """Three workers whose fixed cost per step dominates and differs (their probes say so) join `state` and report
    MEASURED_STEPS steps each: (their ids and fixed costs, the time, the last answer)."""
    per_sample = 1e-5
    ids = {}
    for a in (0.05, 0.05, 0.2):
        wid = state.hello(Hello(role=Role.WORKER), 0.0).id
        welcome_job = state._welcome(state.roster.members[wid]).config
        assert welcome_job["protocol"] == START and welcome_job["staleness_step"] == "delay", "one --lr: delay step"
        sps = 64 / (a + per_sample * 64)
        state.heartbeat(wid, WorkerHeartbeat(standalone_sps=sps, standalone_fixed_s=a), 0.0)
        ids[wid] = a
    _shards_report(state, 0.0)
    _shards_report(state, 0.0)
    assert state.shard_assignment().protocol == START
    now = 0.0
    for _ in range(MEASURED_STEPS):
        now += 0.3
        for wid, a in ids.items():
            m, batch = state.roster.members[wid], state.allocator.allocation[wid]
            step = a + per_sample * batch
            hb = WorkerHeartbeat(
                steps=m.steps + 1,
                samples=m.samples + batch,
                batch=batch,
                times=StepTimes(step_s=step, compute_s=step),
                standalone_sps=m.standalone_sps,
                standalone_fixed_s=a,
                assignment_id=state.allocator.assignment_id,
            )
            answer = state.heartbeat(wid, hb, now)
    return ids, now, answer


def test_the_scheduler_switches_the_shards_first_and_the_workers_once_every_shard_applies_it() -> None:
    """Workers whose fixed cost per step dominates and differs run better where a round sizes their batches than
    under asgd with equal ones: auto chooses from the probes and the measured steps."""
    state = _auto_job(num_shards=2)
    ids, now, answer = _measured(state)
    assert state.protocol is not None
    chosen = state.protocol.chosen
    assert chosen != START and chosen in SWITCHABLE, state.allocator.auto.reason if state.allocator.auto else ""
    assert state.shard_assignment().protocol == chosen, "the shards are told at once"
    assert answer.protocol == START, "the workers keep stepping under asgd until every shard applies the choice"
    _shards_report(state, now, {0: chosen, 1: START})
    assert state.assignment_for(state.roster.members[next(iter(ids))]).protocol == START, "one shard is not there"
    status = state.status(now)
    assert (
        status.protocol == START and status.auto_protocol == chosen and "1 of 2 shards" in status.auto_protocol_reason
    )
    _shards_report(state, now)
    for wid in ids:
        assert state.assignment_for(state.roster.members[wid]).protocol == chosen
    assert state.spec.name == state.allocator.spec.name == chosen
    status = state.status(now)
    assert status.protocol == status.auto_protocol == chosen and "since assignment" in status.auto_protocol_reason
    assert sum(state.allocator.allocation.values()) == 96


def test_a_protocol_a_shard_cannot_run_is_left_out_and_the_shards_go_back() -> None:
    """A shard whose task names its own optimizer cannot take a delta protocol (its outer optimizer would replace
    the task's): it keeps its protocol and says so, and the scheduler chooses among the others."""
    state = _auto_job(num_shards=2)
    _, now, _ = _measured(state)
    assert state.protocol is not None and state.allocator.auto is not None
    chosen = state.protocol.chosen
    assert chosen != START
    _shards_report(state, now, {0: chosen, 1: START})
    shard1 = state.roster.shards[1]
    told = state.shard_assignment()
    state.shard_heartbeat(
        shard1.id, ShardHeartbeat(membership=told.membership, protocol=START, refused_protocol=chosen), now
    )
    assert state.protocol.chosen == START and state.shard_assignment().protocol == START, "shard 0 is told back"
    assert chosen not in state.protocol.plan.protocols and chosen not in state.allocator.auto.protocols
    status = state.status(now)
    assert f"{chosen} left out: shard 1 cannot run it" in status.auto_protocol_reason
    assert status.auto_reason.startswith(f"{START} + {status.auto_policy}: {chosen} left out"), (
        f"the policy's reason still cites the choice of {chosen}, which does not run: {status.auto_reason}"
    )
    _shards_report(state, now)
    assert state.protocol.workers == START and state.protocol.switches == 0


def test_a_shard_whose_task_names_its_optimizer_refuses_a_delta_protocol(tmp_path: Path) -> None:
    served, state = _served(tmp_path)
    with pytest.raises(ConfigError, match="the task's optimizer .* would not be used"):
        served.switch("local", optim_spec.Adam(lr=1e-3))
    assert served.job.protocol == "asgd"
    served.switch("ssgd", optim_spec.Adam(lr=1e-3))  # a gradient protocol steps with the task's optimizer
    assert served.job.protocol == "ssgd"


def test_a_shard_says_which_protocol_its_task_keeps_out_before_auto_chooses_it(tmp_path: Path) -> None:
    """As soon as it holds the model (the README's example task names db.optim.SGD): otherwise auto chose local, the
    shard refused the switch, and the workers' steps pushed meanwhile were thrown away."""
    served, _ = _served(tmp_path)
    assert not unrunnable(served, None) and served.refused_protocol == "", "the job's own SGD runs anywhere"
    assert unrunnable(served, optim_spec.Adam(lr=1e-3)) and served.refused_protocol == "local"
    assert served.job.protocol == "asgd", "nothing switched"
    assert not unrunnable(served, optim_spec.Adam(lr=1e-3)), "said once"


def test_a_protocol_a_shard_says_it_cannot_run_before_the_choice_is_never_chosen() -> None:
    """The workers' protocol (START) stays; the one refused leaves the plan and auto's candidates at once, and the
    choice from the measured steps is among the rest."""
    state = _auto_job(num_shards=1)
    shard = state.roster.shards[0]
    told = state.shard_assignment()
    hb = ShardHeartbeat(membership=told.membership, protocol=START, refused_protocol="local")
    state.shard_heartbeat(shard.id, hb, 0.0)
    assert state.protocol is not None and "local" not in state.protocol.plan.protocols
    assert state.protocol.chosen == state.protocol.workers == START
    _measured(state)
    assert state.allocator.auto is not None and "local" not in state.allocator.auto.protocols
    assert state.protocol.chosen != "local" and "local left out: shard 0" in state.status(0.0).auto_protocol_reason


def test_under_the_delay_step_ringmaster_takes_asgds_step() -> None:
    """`--protocol ringmaster --staleness-step delay`: an accepted gradient of delay tau steps lr / max(1, tau), as
    asgd's, not Ringmaster's own min(1, (R/2) / tau), which is up to R/2 times larger. (Auto runs asgd with that step
    and leaves Ringmaster out: its threshold then only drops the slowest workers' samples, bench/RESULTS.md 38.)"""
    job = JobConfig(protocol="ringmaster", staleness_step="delay", delay_step_samples=8)
    assert "ringmaster" not in switch_plan(JobConfig(protocol="auto")).protocols
    state = ShardState.initial(
        make_layout(600, 1024, 1).chunks, torch.zeros(600), SGD, "ringmaster", B, protocol_settings(job)
    )
    state.set_membership({f"w{i}" for i in range(8)}, allocated=8)
    rule = state.rule
    assert isinstance(rule, RingmasterRule)
    even = B // 8
    assert [rule.weight(even, t) for t in (0, 1, 4, 7)] == [1.0, 1.0, 0.25, 1 / 7]
    assert rule.weight(2, 1) == 2 / 8, "and asgd's bound per sample (--delay-step-samples)"
    own = ShardState.initial(make_layout(600, 1024, 1).chunks, torch.zeros(600), SGD, "ringmaster", B)
    own.set_membership({f"w{i}" for i in range(8)}, allocated=8)
    assert isinstance(own.rule, RingmasterRule) and own.rule.weight(even, 4) == 1.0, "its own step: min(1, 4 / 4)"


def test_a_named_batch_policy_the_predictor_does_not_model_keeps_the_protocol() -> None:
    """`--protocol auto --batch-policy efficient`: nothing to choose the protocol by, so it stays, saying why."""
    state = JobState(
        JobConfig(protocol="auto", batch_policy="efficient", dataset="synthetic", model="mlp"), 1, 1000, now=0.0
    )
    auto = state.allocator.auto
    assert auto is not None and not auto.modelled and "--batch-policy efficient" in auto.reason
    assert not auto.revisit({}, {}, 0) and auto.protocol == START


def test_a_restarted_scheduler_goes_on_under_the_protocol_it_had_switched_to(tmp_path: Path) -> None:
    state = _auto_job(num_shards=2)
    _, now, _ = _measured(state)
    assert state.protocol is not None
    chosen = state.protocol.chosen
    _shards_report(state, now)
    assert state.protocol.workers == chosen != START
    path = tmp_path / "progress.json"
    save_progress(path, state.saved(now, read_clock()))
    saved = load_progress(path, to_dict(state.job))
    assert saved is not None and saved.protocol == chosen
    resumed = _auto_job(num_shards=2)
    resumed.resume(saved, now, read_clock())
    assert resumed.protocol is not None and resumed.protocol.workers == resumed.protocol.chosen == chosen
    assert resumed.spec.name == resumed.allocator.spec.name == chosen
    assert resumed.shard_assignment().protocol == chosen and resumed.running_job.protocol == chosen
    assert resumed.allocator.auto is not None and resumed.allocator.auto.protocol == chosen


def test_a_worker_leaving_a_pipelined_loop_unhooks_its_model() -> None:
    """The pipelined gradient step hooks every layer's forward and every parameter's gradient; a step that failed
    (a `switched` refusal among them) leaves its state behind. The next protocol's loop runs passes on the same
    model, so leaving the loop must take the hooks with it, or they would push that old step's gradients again."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    total = sum(p.numel() for p in model.parameters())
    layout = make_layout(total, 64, 1)
    shards = ShardClients(zmq.Context.instance(), [f"tcp://127.0.0.1:{free_port()}"], layout, "j", "w")
    try:

        def hooks() -> int:
            layers = sum(len(m._forward_pre_hooks) for m in model.modules())
            return layers + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

        pipeline = Pipeline(model, layout, shards, 1 << 20, 1.0, lambda m, batch: m(batch).sum())
        assert hooks() == 2 + 4, "two layers' forward, four parameters' gradients"
        pipeline._step = object()  # type: ignore[assignment]  # what a failed step leaves behind
        pipeline.close()
        assert hooks() == 0 and pipeline._step is None
        model(torch.ones(3, 8)).sum().backward()  # the next loop's pass: nothing of the old step acts on it
    finally:
        shards.close()
