"""The shard's protocols against a plain-torch reference, and its checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from dynabatch import optim as optim_spec
from dynabatch.common.protocols import (
    AsyncSettings,
    MsyncSettings,
    OuterSettings,
    RingmasterSettings,
    SoftsyncSettings,
    SspSettings,
)
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.checkpoint import load_checkpoint, save_checkpoint
from dynabatch.ps.protocol_rules import StaleSynchronousRule
from dynabatch.ps.shard_state import PushOutcome, ShardState, StaleGradient

SGD = optim_spec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=False)
B = 96
T = TypeVar("T")


def _state(protocol: str, total: int = 1000, chunk_bytes: int = 1024, **kw: Any) -> tuple[ShardState, torch.Tensor]:
    flat = torch.randn(total, generator=torch.Generator().manual_seed(3))
    layout = make_layout(total, chunk_bytes, 1)
    state = ShardState.initial(layout.chunks, flat, SGD, protocol, B, **kw)
    state.set_membership({"w0", "w1", "w2"}, allocated=3)
    return state, flat


def _push(state: ShardState, worker: str, g: torch.Tensor, base: int, samples: int, now: float = 0.0) -> PushOutcome:
    chunks = _split(state, g)
    return state.push(worker, chunks, {cid: base for cid in chunks}, samples, state.kind, now)


def _split(state: ShardState, g: torch.Tensor) -> dict[int, torch.Tensor]:
    return {c.id: g[c.start : c.stop] for c in state.chunks}


def _flat(state: ShardState) -> torch.Tensor:
    return torch.cat([state.params[c.id] for c in state.chunks])


def _reference(w0: torch.Tensor, steps: list[tuple[torch.Tensor, float]], lr_factor: float = 1.0) -> torch.Tensor:
    """torch's SGD over (gradient, weight) steps: a weight scales the gradient and its weight decay, which is
    what it adds to the momentum buffer (ps/update_rules.py's sgd_step_); `lr_factor` scales the rate."""
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=SGD.lr * lr_factor, momentum=SGD.momentum)
    for g, weight in steps:
        opt.param_groups[0]["weight_decay"] = SGD.weight_decay * weight
        p.grad = g * weight
        opt.step()
    return p.detach()


@pytest.mark.parametrize("rule, weight", [("paper", lambda b: b * 3 / B), ("capped", lambda b: min(1.0, b * 3 / B))])
def test_asgd_applies_each_gradient_on_arrival_weighted_by_its_batch(rule: str, weight: Callable[[int], float]) -> None:
    state, w0 = _state("asgd", dbs_rule=rule)
    gen = torch.Generator().manual_seed(0)
    pushes = [("w0", 64), ("w1", 22), ("w2", 10), ("w0", 64), ("w2", 10)]  # B = 96: w0's weight is 2 or 1
    steps = []
    for i, (worker, samples) in enumerate(pushes):
        g = torch.randn(1000, generator=gen)
        out = _push(state, worker, g, base=max(0, i - 1), samples=samples)
        assert len(out.applied) == len(state.chunks) and out.version == i + 1
        assert out.staleness == (1 if i > 0 else 0)
        steps.append((g, weight(samples)))
    torch.testing.assert_close(_flat(state), _reference(w0, steps))
    assert set(state.chunk_versions.values()) == {5}


def test_ssgd_waits_for_every_live_worker_then_applies_the_sample_weighted_mean() -> None:
    state, w0 = _state("ssgd")
    gen = torch.Generator().manual_seed(1)
    grads = {w: torch.randn(1000, generator=gen) for w in ("w0", "w1", "w2")}
    samples = {"w0": 64, "w1": 22, "w2": 10}
    assert not _push(state, "w0", grads["w0"], 0, 64).applied
    assert not _push(state, "w1", grads["w1"], 0, 22, 0.1).applied
    assert state.version == 0 and torch.equal(_flat(state), w0)
    out = _push(state, "w2", grads["w2"], 0, 10, 0.2)
    assert len(out.applied) == len(state.chunks) and out.version == 1
    mean = sum(samples[w] * grads[w] for w in grads) / sum(samples.values())
    assert isinstance(mean, torch.Tensor)
    torch.testing.assert_close(_flat(state), _reference(w0, [(mean, 1.0)]))


def test_ssgd_round_closes_when_the_missing_worker_leaves() -> None:
    state, w0 = _state("ssgd")
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32)
    _push(state, "w1", 2 * g, 0, 32)
    assert state.version == 0
    assert state.set_membership({"w0", "w1"}, allocated=2) == [c.id for c in state.chunks]
    assert state.version == 1
    torch.testing.assert_close(_flat(state), _reference(w0, [(1.5 * g, 1.0)]))


def test_ssgd_round_timeout_applies_what_arrived() -> None:
    state, w0 = _state("ssgd")
    _push(state, "w0", torch.ones(1000), 0, 32, now=10.0)
    assert not state.overdue(14.0, 5.0)
    assert state.overdue(15.5, 5.0) == [c.id for c in state.chunks]
    assert all(state.close_round(cid) for cid in state.overdue(15.5, 5.0)) and state.version == 1
    assert not state.overdue(100.0, 5.0)


def test_an_ssgd_round_times_out_on_every_chunk_at_once_so_that_a_late_push_lands_in_one_round() -> None:
    """The step's messages open the chunks' rounds moments apart; a push arriving while some had timed out and
    others not would have joined two rounds, leaving the chunks a round apart for good."""
    state, _ = _state("ssgd")
    first, *rest = state.chunks
    for worker in ("w0", "w1"):
        g = _split(state, torch.ones(1000))
        state.push(worker, {first.id: g[first.id]}, {first.id: 0}, 32, state.kind, 10.0)
        state.push(worker, {c.id: g[c.id] for c in rest}, {c.id: 0 for c in rest}, 32, state.kind, 10.01)
    assert state.overdue(15.005, 5.0) == [c.id for c in state.chunks]
    assert all(state.close_round(cid) for cid in state.overdue(15.005, 5.0))
    assert set(state.chunk_versions.values()) == {1} and state.version == 1
    with pytest.raises(StaleGradient):  # the late worker's push, on the model of the round that closed
        _push(state, "w2", torch.ones(1000), 0, 32, now=15.01)
    assert set(state.chunk_versions.values()) == {1}


def test_an_ssgd_pull_waiting_for_a_version_gets_no_chunk_whose_open_round_holds_its_own_push() -> None:
    """Chunks a round apart (a push taken on some and refused on the others): the shard's version, its least
    advanced chunk's, is reached while the leading chunk's round still holds the worker's push. Sent, that chunk
    came back at the version just pushed, and the worker's next push was refused "already pushed"."""
    state, _ = _state("ssgd")
    state.set_membership({"w0", "w1"}, allocated=2)
    lead, lag, *_ = state.chunks
    g = _split(state, torch.ones(1000))
    for worker in ("w0", "w1"):
        state.push(worker, {lead.id: g[lead.id]}, {lead.id: 0}, 32, state.kind, 0.0)
    assert state.chunk_versions[lead.id] == 1 and state.version == 0
    state.push("w0", {lead.id: g[lead.id]}, {lead.id: 1}, 32, state.kind, 0.0)  # its next step, a round ahead
    state.push("w0", {lag.id: g[lag.id]}, {lag.id: 0}, 32, state.kind, 0.0)
    assert not state.due(lead.id, "w0", 1) and not state.due(lag.id, "w0", 1)
    assert state.due(lead.id, "w1", 1), "its own push is not in that round"
    assert state.due(lead.id, "w0", 0), "a pull that waits for no version gets what there is"
    state.push("w1", {lag.id: g[lag.id]}, {lag.id: 0}, 32, state.kind, 0.0)
    assert state.chunk_versions[lag.id] == 1 and state.due(lag.id, "w0", 1) and not state.due(lead.id, "w0", 1)
    state.push("w1", {lead.id: g[lead.id]}, {lead.id: 1}, 32, state.kind, 0.0)
    assert state.chunk_versions[lead.id] == 2 and state.due(lead.id, "w0", 1)


def test_ssgd_refuses_a_second_push_in_one_round() -> None:
    state, _ = _state("ssgd")
    _push(state, "w0", torch.ones(1000), 0, 32)
    with pytest.raises(ProtocolError, match="bad_state"):
        _push(state, "w0", torch.ones(1000), 0, 32)


def test_unknown_workers_and_pushes_of_another_kind_change_nothing() -> None:
    state, w0 = _state("asgd")
    with pytest.raises(ProtocolError, match="unknown_sender"):
        state.check_live("w9")
    state.check_live("w0")
    with pytest.raises(ProtocolError, match="kind"):
        state.push("w0", _split(state, torch.ones(1000)), {c.id: 0 for c in state.chunks}, 32, "delta", 0.0)
    assert state.version == 0 and torch.equal(_flat(state), w0)


def test_pull_gives_all_chunks_in_priority_order_or_refuses_unknown_ids() -> None:
    state, w0 = _state("asgd")
    items = state.pull([])
    assert [cid for cid, _, _ in items] == sorted(c.id for c in state.chunks)
    torch.testing.assert_close(torch.cat([t for _, t, _ in items]), w0)
    with pytest.raises(ProtocolError, match="unknown_chunk"):
        state.pull([999])


def test_checkpoint_round_trip_restores_version_parameters_and_momentum(tmp_path: Path) -> None:
    state, _ = _state("asgd")
    for i in range(3):
        _push(state, "w0", torch.full((1000,), float(i + 1)), i, 32)
    meta = {"job": "j", "shard": 0, "total": 1000}
    path = tmp_path / "shard-0.pt"
    save_checkpoint(path, meta, state.snapshot())
    assert [p.name for p in tmp_path.iterdir()] == ["shard-0.pt"], "no temporary file may be left behind"
    fresh, _ = _state("asgd")
    saved = load_checkpoint(path, meta)
    assert saved is not None
    fresh.restore(saved)
    assert fresh.version == 3
    for c in state.chunks:
        assert torch.equal(fresh.params[c.id], state.params[c.id])
        assert torch.equal(fresh.optim[c.id].state_dict()["momentum"], state.optim[c.id].state_dict()["momentum"])
    with pytest.raises(ValueError, match="checkpoint of another job"):
        load_checkpoint(path, {**meta, "shard": 1})
    assert load_checkpoint(tmp_path / "absent.pt", meta) is None


def test_restore_refuses_a_checkpoint_of_another_layout(tmp_path: Path) -> None:
    state, _ = _state("asgd", total=1000)
    other, _ = _state("asgd", total=500)
    with pytest.raises(ValueError, match="different chunks"):
        other.restore(state.snapshot())


def test_softsync_waits_for_floor_workers_over_n_gradients_and_damps_stale_ones() -> None:
    state, w0 = _state("softsync", settings=SoftsyncSettings(1))
    gen = torch.Generator().manual_seed(4)
    g = [torch.randn(1000, generator=gen) for _ in range(3)]
    # Arrivals: w0 (fresh), w0 again (a fast worker may contribute twice), w2 computed 3 versions ago.
    assert not _push(state, "w0", g[0], 0, 40).applied
    assert not _push(state, "w0", g[1], 0, 40).applied
    state.chunk_versions = {cid: 3 for cid in state.chunk_versions}
    out = _push(state, "w2", g[2], 0, 20)
    assert len(out.applied) == len(state.chunks)
    combined = (40 * g[0] + 40 * g[1] + 20 * g[2] / 3) / 100
    torch.testing.assert_close(_flat(state), _reference(w0, [(combined, 1.0)]))


def test_two_softsync_updates_when_n_halves_the_wait() -> None:
    state, w0 = _state("softsync", settings=SoftsyncSettings(2))
    state.set_membership({"w0", "w1", "w2", "w3"}, allocated=4)
    gen = torch.Generator().manual_seed(5)
    g = [torch.randn(1000, generator=gen) for _ in range(4)]
    steps = []
    for i in range(0, 4, 2):
        assert not _push(state, f"w{i}", g[i], state.version, 10).applied
        assert _push(state, f"w{i + 1}", g[i + 1], state.version, 30).applied
        steps.append(((10 * g[i] + 30 * g[i + 1]) / 40, 1.0))
    torch.testing.assert_close(_flat(state), _reference(w0, steps))


def _local_sgd_reference(
    w0: torch.Tensor,
    deltas: list[list[torch.Tensor]],
    samples: list[int],
    outer_lr: float,
    outer_momentum: float,
    rounds: int,
) -> torch.Tensor:
    """Plain torch: the outer optimizer of local SGD / DiLoCo is SGD on the averaged delta."""
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    for r in range(rounds):
        mean = sum(s * d for s, d in zip(samples, deltas[r], strict=True)) / sum(samples)
        assert isinstance(mean, torch.Tensor)
        p.grad = mean
        opt.step()
    return p.detach()


@pytest.mark.parametrize("protocol", ["local", "msd"])
@pytest.mark.parametrize("outer", [OuterSettings(1.0, 0.0), OuterSettings(0.7, 0.9, True)])
def test_delta_protocols_average_deltas_by_samples_and_apply_the_outer_optimizer(
    protocol: str, outer: OuterSettings
) -> None:
    state, w0 = _state(protocol, settings=outer)
    gen = torch.Generator().manual_seed(6)
    samples = [120, 50, 22]
    deltas = [[0.1 * torch.randn(1000, generator=gen) for _ in samples] for _ in range(3)]
    for r in range(3):
        for i, s in enumerate(samples):
            out = _push(state, f"w{i}", deltas[r][i], r, s)
            assert bool(out.applied) == (i == len(samples) - 1), "a round closes when the last worker pushes"
    assert state.version == 3
    torch.testing.assert_close(_flat(state), _local_sgd_reference(w0, deltas, samples, outer.lr, outer.momentum, 3))


def test_plain_averaging_lands_on_the_mean_of_the_local_models() -> None:
    state, w0 = _state("local")
    locals_ = [w0 + 0.1 * i for i in range(3)]
    for i, w in enumerate(locals_):
        _push(state, f"w{i}", w0 - w, 0, 10)
    torch.testing.assert_close(_flat(state), sum(locals_) / 3)


def test_gradient_protocols_refuse_deltas_and_delta_protocols_refuse_gradients() -> None:
    for protocol, wrong in (
        ("asgd", "delta"),
        ("ssgd", "delta"),
        ("softsync", "delta"),
        ("local", "grad"),
        ("msd", "grad"),
    ):
        state, w0 = _state(protocol)
        with pytest.raises(ProtocolError, match="kind"):
            state.push("w0", _split(state, torch.ones(1000)), {c.id: 0 for c in state.chunks}, 32, wrong, 0.0)
        assert torch.equal(_flat(state), w0)


def test_chunks_are_applied_one_by_one_as_they_arrive() -> None:
    state, w0 = _state("ssgd", chunk_bytes=400)
    assert len(state.chunks) >= 3
    g = torch.ones(1000)
    first = state.chunks[0]
    for w in ("w0", "w1", "w2"):
        out = state.push(w, {first.id: g[first.start : first.stop]}, {first.id: 0}, 10, "grad", 0.0)
    assert out.applied == [first.id]
    assert state.chunk_versions[first.id] == 1 and state.version == 0
    assert all(state.chunk_versions[c.id] == 0 for c in state.chunks[1:])


def test_asgd_weighs_by_the_workers_holding_a_batch_not_by_those_still_joining() -> None:
    """DBS-SGD's n is the scheduler's allocation: a joining worker (live, no batch yet) changes no weight."""
    state, w0 = _state("asgd")
    state.set_membership({"w0", "w1", "w2", "w3"}, allocated=3)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    _push(state, "w0", g, 0, B // 3)
    torch.testing.assert_close(_flat(state), _reference(w0, [(g, 1.0)]))


def _ssp(staleness_bound: int) -> ShardState:
    state, _ = _state("ssp", settings=SspSettings(staleness_bound))
    state.set_membership({"w0", "w1"}, allocated=2)
    return state


def test_ssp_with_bound_zero_holds_a_worker_one_step_ahead_until_the_slowest_catches_up() -> None:
    state = _ssp(0)
    g = torch.ones(1000)
    assert not state.pull_blocked("w0") and not state.pull_blocked("w1")
    _push(state, "w0", g, 0, 32)
    assert state.pull_blocked("w0"), "w0 is a step ahead of w1: its next pull waits"
    assert not state.pull_blocked("w1")
    _push(state, "w1", g, 0, 32)
    assert not state.pull_blocked("w0") and state.version == 2, "every push is applied on arrival"
    assert state.rule.widest_spread == 1


def _push_watching(state: ShardState, worker: str, watch: Callable[[int], T]) -> list[T]:
    """Push ones from `worker`, calling `watch()` after each chunk is taken; what it returned, in order."""
    seen: list[T] = []
    chunks = _split(state, torch.ones(1000))
    state.push(worker, chunks, {cid: 0 for cid in chunks}, 32, state.kind, 0.0, lambda cid: seen.append(watch(cid)))
    return seen


def test_a_push_reports_each_chunk_once_it_is_applied_and_before_the_next_is() -> None:
    """What lets the shard send chunk k back while it updates chunk k+1."""
    state, _ = _state("asgd")
    seen = _push_watching(state, "w0", lambda cid: (cid, dict(state.chunk_versions)))
    ids = [c.id for c in state.chunks]
    assert len(ids) > 1 and [cid for cid, _ in seen] == ids
    for k, (_, versions) in enumerate(seen):
        assert versions == {cid: int(j <= k) for j, cid in enumerate(ids)}
    assert state.streams


def test_ssp_does_not_stream_because_only_the_whole_push_decides_whether_its_worker_may_pull() -> None:
    state = _ssp(0)
    blocked = _push_watching(state, "w0", lambda cid: state.pull_blocked("w0"))
    assert blocked[-1] and not any(blocked[:-1]), "sent chunk by chunk, all but the last would escape the bound"
    assert not state.streams


def test_ssp_bound_s_lets_a_worker_run_s_steps_ahead_and_no_more() -> None:
    state = _ssp(3)
    for step in range(4):
        assert not state.pull_blocked("w0"), f"{step} steps ahead is within the bound"
        _push(state, "w0", torch.ones(1000), step, 32)
    assert state.pull_blocked("w0")
    _push(state, "w1", torch.ones(1000), 0, 32)
    assert not state.pull_blocked("w0")


def test_ssp_a_joining_worker_starts_at_the_slowest_clock_and_a_leaver_holds_nobody_back() -> None:
    state = _ssp(0)
    for w in ("w0", "w1", "w0"):
        _push(state, w, torch.ones(1000), 0, 32)
    assert state.pull_blocked("w0")
    state.set_membership({"w0", "w1", "w2"}, allocated=3)
    assert not state.pull_blocked("w2"), "the newcomer starts level with the slowest (w1), not at 0"
    assert state.pull_blocked("w0") and not state.pull_blocked("w1")
    state.set_membership({"w0", "w2"}, allocated=2)
    state.set_membership({"w0"}, allocated=1)
    assert not state.pull_blocked("w0"), "with the slower workers gone, w0 is the slowest"


def test_ssp_holds_nobody_back_for_a_worker_that_holds_no_batch() -> None:
    """A worker left out with batch 0, or whose allotment of the job's samples is trained, takes no step: the
    others' pulls do not wait for its clock, as they would for ever at the job's end; given a batch again, it
    is the slowest once more."""
    state = _ssp(0)
    _push(state, "w0", torch.ones(1000), 0, 32)
    assert state.pull_blocked("w0")
    state.set_membership({"w0", "w1"}, allocated=1, idle={"w1"})
    assert isinstance(state.rule, StaleSynchronousRule)
    assert not state.pull_blocked("w0") and state.rule.spread() == 0
    _push(state, "w0", torch.ones(1000), 1, 32)
    assert not state.pull_blocked("w0")
    state.set_membership({"w0", "w1"}, allocated=2)
    assert state.pull_blocked("w0") and not state.pull_blocked("w1")


@pytest.mark.parametrize(
    "protocol, settings",
    [
        ("asgd", AsyncSettings(staleness_step="delay", delay_step_samples=2 * (B // 3))),
        ("ssp", SspSettings(100, staleness_step="delay", delay_step_samples=2 * (B // 3))),
        ("ringmaster", RingmasterSettings(10, staleness_step="delay", delay_step_samples=2 * (B // 3))),
    ],
)
def test_the_delay_step_divides_each_gradients_step_by_its_staleness(protocol: str, settings: AsyncSettings) -> None:
    """--staleness-step delay: gradients 0, 1, 2 and 3 versions stale (B/n samples each, DBS weight 1) step at lr /
    max(1, tau), at most lr b / --delay-step-samples: here half of lr, so 0.5, 0.5, 0.5 and 1/3 of it. Ringmaster
    (R 10) would take all four at lr under its own step, min(1, (R / 2) / tau)."""
    state, w0 = _state(protocol, settings=settings)
    gen = torch.Generator().manual_seed(10)
    steps = []
    for worker, base, tau in (("w0", 0, 0), ("w1", 0, 1), ("w2", 0, 2), ("w0", 0, 3)):
        g = torch.randn(1000, generator=gen)
        assert _push(state, worker, g, base, B // 3).staleness == tau
        steps.append((g, min(1.0 / max(1, tau), 0.5)))
    torch.testing.assert_close(_flat(state), _reference(w0, steps))


def test_ssp_applies_gradients_exactly_as_asgd_does() -> None:
    ssp, asgd = _ssp(100), _state("asgd")[0]
    asgd.set_membership({"w0", "w1"}, allocated=2)
    gen = torch.Generator().manual_seed(8)
    for i, (worker, samples) in enumerate([("w0", 64), ("w1", 32), ("w0", 64)]):
        g = torch.randn(1000, generator=gen)
        assert _push(ssp, worker, g, i, samples) == _push(asgd, worker, g, i, samples)
    assert torch.equal(_flat(ssp), _flat(asgd))


def test_the_schedules_factor_scales_every_update() -> None:
    state, w0 = _state("asgd")
    state.follow_job(0.0, 0.25)  # the job's factor after rollbacks, on a constant schedule
    g = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    _push(state, "w0", g, 0, B // 3)
    torch.testing.assert_close(_flat(state), _reference(w0, [(g, 1.0)], lr_factor=0.25))


@pytest.mark.parametrize(
    "total, chunk_bytes, shards", [(1000, 1 << 20, 2), (1000, 1 << 20, 3), (7, 4, 7), (10_000, 4096, 2)]
)
def test_every_shard_holds_part_of_the_model_and_each_has_a_version(total: int, chunk_bytes: int, shards: int) -> None:
    """A model that fits one chunk is cut finer rather than leave a shard empty (it crashed on min() of nothing)."""
    layout = make_layout(total, chunk_bytes, shards)
    assert sum(c.length for c in layout.chunks) == total and all(c.length * 4 <= chunk_bytes for c in layout.chunks)
    for shard in range(shards):
        mine = [c for c in layout.chunks if c.owner == shard]
        state = ShardState.initial(mine, torch.zeros(total), SGD, "asgd", B)
        assert state.sizes and state.version == 0


def test_a_model_smaller_than_its_shard_count_is_refused() -> None:
    with pytest.raises(ValueError, match="3 parameters cannot be spread over 4 shards"):
        make_layout(3, 1 << 20, 4)


def _unchanged(state: ShardState, w0: torch.Tensor, version: int = 0) -> bool:
    return state.version == version and torch.equal(_flat(state), w0)


def test_ringmaster_discards_a_gradient_whose_delay_reaches_r_and_changes_nothing() -> None:
    state, _ = _state("ringmaster", settings=RingmasterSettings(max_delay=2))
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32)
    _push(state, "w1", g, 1, 32)
    before = _flat(state).clone()
    momentum = {cid: opt.state_dict()["momentum"].clone() for cid, opt in state.optim.items()}
    with pytest.raises(StaleGradient) as refused:
        _push(state, "w2", g, 0, 32)  # computed at version 0, the shard is at 2: delay 2 = R
    assert refused.value.code == ErrorCode.TOO_STALE and ErrorCode.TOO_STALE.value == "too_stale"
    assert state.version == 2 and torch.equal(_flat(state), before)
    assert all(torch.equal(opt.state_dict()["momentum"], momentum[cid]) for cid, opt in state.optim.items())
    assert (state.discarded, state.discarded_samples) == (1, 32)
    assert _push(state, "w2", g, 1, 32).applied, "delay 1 < R is taken"


def test_ringmaster_r_defaults_to_the_live_workers_and_scales_the_step_by_its_delay() -> None:
    state, w0 = _state("ringmaster")
    assert state.rule.max_delay() == 3, "three live workers"
    state.set_membership({"w0", "w1", "w2", "w3"}, allocated=4)
    assert state.rule.max_delay() == 4
    gen = torch.Generator().manual_seed(11)
    g = [torch.randn(1000, generator=gen) for _ in range(4)]
    for i in range(3):
        _push(state, f"w{i}", g[i], i, B // 4)  # delay 0: full step
    _push(state, "w3", g[3], 0, B // 4)  # delay 3 of R = 4: lr * min(1, (R/2) / 3) = lr * 2/3
    _push(state, "w0", g[0], 4, B // 8)  # half the mean batch: weight 1/2, never above 1
    expected = _reference(w0, [(g[0], 1.0), (g[1], 1.0), (g[2], 1.0), (g[3], 2 / 3), (g[0], 0.5)])
    torch.testing.assert_close(_flat(state), expected)
    _push(state, "w1", g[1], 5, 4 * B)
    torch.testing.assert_close(
        _flat(state), _reference(w0, [(g[0], 1.0), (g[1], 1.0), (g[2], 1.0), (g[3], 2 / 3), (g[0], 0.5), (g[1], 1.0)])
    )


def test_rennala_steps_once_b_samples_at_the_current_version_are_in_and_discards_older_ones() -> None:
    state, w0 = _state("rennala")
    gen = torch.Generator().manual_seed(12)
    g = [torch.randn(1000, generator=gen) for _ in range(4)]
    assert not _push(state, "w0", g[0], 0, 40).applied
    assert not _push(state, "w0", g[1], 0, 40).applied, "a fast worker contributes twice to a round"
    assert _unchanged(state, w0)
    out = _push(state, "w1", g[2], 0, 16)
    assert out.applied == [c.id for c in state.chunks] and state.version == 1, "40 + 40 + 16 = B: one step"
    mean = (40 * g[0] + 40 * g[1] + 16 * g[2]) / 96
    after = _reference(w0, [(mean, 1.0)])
    torch.testing.assert_close(_flat(state), after)
    with pytest.raises(StaleGradient):
        _push(state, "w2", g[3], 0, 64)  # computed at version 0, the round is at 1
    torch.testing.assert_close(_flat(state), after)
    assert state.discarded == 1 and state.version == 1
    assert not _push(state, "w2", g[3], 1, 95).applied, "95 < B samples: no step yet"
    assert _push(state, "w0", g[0], 1, 1).applied and state.version == 2


def test_msync_applies_the_first_m_of_a_round_and_discards_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    """m = 2 of three workers: each round steps once, on the sample-weighted mean of the first two gradients
    computed at its model; the third, computed at the old model, is discarded and counted, and changes nothing."""
    state, w0 = _state("msync", settings=MsyncSettings(2))
    gen = torch.Generator().manual_seed(13)
    g = [torch.randn(1000, generator=gen) for _ in range(5)]
    assert not _push(state, "w2", g[0], 0, 32).applied
    assert _unchanged(state, w0)
    out = _push(state, "w0", g[1], 0, 64)
    assert out.applied == [c.id for c in state.chunks] and state.version == 1, "the second gradient closes the round"
    first = _reference(w0, [((32 * g[0] + 64 * g[1]) / 96, 1.0)])
    torch.testing.assert_close(_flat(state), first)
    with pytest.raises(StaleGradient):
        _push(state, "w1", g[2], 0, 32)  # the round's third: computed at version 0, the model is at 1
    torch.testing.assert_close(_flat(state), first)
    assert (state.discarded, state.discarded_samples, state.version) == (1, 32, 1)
    assert not _push(state, "w1", g[3], 1, 32).applied, "the late worker's next gradient enters the next round"
    with pytest.raises(ProtocolError, match="already pushed"):
        _push(state, "w1", g[3], 1, 32)
    assert _push(state, "w2", g[4], 1, 32).applied and state.version == 2, "one version per round"
    torch.testing.assert_close(
        _flat(state), _reference(w0, [((32 * g[0] + 64 * g[1]) / 96, 1.0), ((g[3] + g[4]) / 2, 1.0)])
    )
    _push(state, "w0", g[0], 2, 32)
    with caplog.at_level("WARNING", logger="dynabatch.ps"):
        state.set_membership({"w0"}, allocated=1)
    assert state.version == 3, "m clamped to the one live worker: its waiting gradient closes the round"
    assert "--sync-m 2 clamped to the 1 live worker(s)" in caplog.text


def test_msync_chooses_a_rounds_m_workers_on_the_shard_not_chunk_by_chunk() -> None:
    """A pipelined step pushes a shard's chunks in several messages: the first two workers to push any chunk of a
    version are that round's on every chunk, and the third's push of that version is discarded even on a chunk
    whose round is still open, so no gradient is taken on some chunks and discarded on others."""
    state, _ = _state("msync", settings=MsyncSettings(2))
    chunks = [c.id for c in state.chunks]
    assert len(chunks) >= 2
    g = _split(state, torch.ones(1000))

    def push(worker: str, ids: list[int]) -> PushOutcome:
        return state.push(worker, {c: g[c] for c in ids}, {c: 0 for c in ids}, 32, state.kind, 0.0)

    push("w0", chunks[:1])
    push("w1", chunks[1:])
    with pytest.raises(StaleGradient, match="whose round already has the gradients it takes"):
        push("w2", chunks[:1])
    assert state.version == 0 and state.discarded == 1
    assert push("w1", chunks[:1]).applied == chunks[:1]
    assert push("w0", chunks[1:]).applied == chunks[1:] and state.version == 1

    def push_at_1(worker: str, ids: list[int]) -> PushOutcome:
        return state.push(worker, {c: g[c] for c in ids}, {c: 1 for c in ids}, 32, state.kind, 0.0)

    push_at_1("w0", chunks[:1])
    push_at_1("w1", chunks[1:])
    state.set_membership({"w0", "w2"}, allocated=2)
    push_at_1("w2", chunks[:1])  # w1, chosen, left: w2 takes its place
    assert push_at_1("w0", chunks[1:]).applied == [] and push_at_1("w2", chunks[1:]).applied == chunks[1:]
    assert state.version == 2


def test_msync_m_0_waits_for_every_live_worker_as_ssgd() -> None:
    state, _ = _state("msync", settings=MsyncSettings(0))
    g = torch.ones(1000)
    assert not _push(state, "w0", g, 0, 32).applied and not _push(state, "w1", g, 0, 32).applied
    assert _push(state, "w2", g, 0, 32).applied and state.version == 1


def test_rennala_holds_a_pull_while_the_round_has_its_samples_on_their_way() -> None:
    state, _ = _state("rennala")
    g = torch.ones(1000)
    for w in ("w0", "w1", "w2"):  # each pulls (its batch not known yet) and pushes once: they count from then on
        assert state.admit_pull(w)
        _push(state, w, g, 0, 30)
    assert state.version == 0, "90 of 96"
    assert state.admit_pull("w0"), "w0 starts the gradient that completes the round"
    assert state.pull_blocked("w1") and not state.admit_pull("w1"), "90 in + w0's 30 on its way >= B: w1 waits"
    assert not state.pull_blocked("w0"), "w0 is already counted on its way"
    _push(state, "w0", g, 0, 30)
    assert state.version == 1 and state.admit_pull("w1"), "the round closed: the held pull gets the new model"


def test_rennala_forgets_a_worker_on_its_way_once_it_leaves_or_is_left_out() -> None:
    state, _ = _state("rennala")
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 90)
    _push(state, "w1", g, 0, 1)
    assert state.admit_pull("w0") and state.pull_blocked("w1")
    state.set_membership({"w0", "w1", "w2"}, allocated=2, idle={"w0"})
    assert not state.pull_blocked("w1"), "w0 holds batch 0 now: its gradient is not awaited"
    state.set_membership({"w1", "w2"}, allocated=2)
    assert state.admit_pull("w1")


def test_rennala_round_closes_at_the_timeout_with_what_arrived() -> None:
    state, w0 = _state("rennala")
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32, now=10.0)
    assert not state.overdue(14.0, 5.0)
    assert all(state.close_round(cid) for cid in state.overdue(15.5, 5.0)) and state.version == 1
    torch.testing.assert_close(_flat(state), _reference(w0, [(g, 1.0)]))


@pytest.mark.parametrize("protocol", ["rennala", "softsync"])
def test_a_pooled_round_closes_once_no_live_worker_holds_a_batch(protocol: str) -> None:
    """The job's last samples, fewer than a round's: once every worker has trained its allotment (the scheduler
    lists them idle) nobody can add to the round, and it is applied before the job's end, not left open."""
    state, w0 = _state(protocol)
    state.set_membership({"w0", "w1", "w2", "w3"}, allocated=4)  # softsync: 4 gradients a round
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32)
    assert state.set_membership({"w0", "w1", "w2", "w3"}, allocated=4, idle={"w0", "w1"}) == []
    assert state.version == 0, "w2 and w3 may still push into it"
    assert state.set_membership({"w0", "w1", "w2", "w3"}, allocated=4, idle={"w0", "w1", "w2", "w3"})
    assert state.version == 1
    torch.testing.assert_close(_flat(state), _reference(w0, [(g, 1.0)]))


def test_ssgd_rounds_do_not_wait_for_a_worker_left_out_with_batch_0() -> None:
    state, w0 = _state("ssgd")
    state.set_membership({"w0", "w1", "w2"}, allocated=2, idle={"w2"})
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32)
    assert _push(state, "w1", 3 * g, 0, 32).applied
    torch.testing.assert_close(_flat(state), _reference(w0, [(2 * g, 1.0)]))
    state.set_membership({"w0", "w1", "w2"}, allocated=3)
    _push(state, "w0", g, 1, 32)
    _push(state, "w1", g, 1, 32)
    assert state.version == 1, "w2 has a batch again: the round waits for it"
    state.set_membership({"w0", "w1", "w2"}, allocated=2, idle={"w2"})
    assert state.version == 2, "left out again: the round closes without it"


def test_ssgd_discards_a_gradient_of_a_round_that_closed_without_its_worker() -> None:
    """w2 pulled version 0, was left out while it computed, and has a batch again when its gradient arrives: the
    gradient belongs to a round that closed without it, so it is discarded (as the simulator found: taken, it
    entered round 1 and w2's next push into round 1 was refused as a second one)."""
    state, _ = _state("ssgd")
    state.set_membership({"w0", "w1", "w2"}, allocated=2, idle={"w2"})
    g = torch.ones(1000)
    _push(state, "w0", g, 0, 32)
    _push(state, "w1", g, 0, 32)
    state.set_membership({"w0", "w1", "w2"}, allocated=3)
    before = _flat(state).clone()
    with pytest.raises(StaleGradient):
        _push(state, "w2", g, 0, 32)
    assert torch.equal(_flat(state), before) and state.version == 1 and state.discarded == 1
    _push(state, "w0", g, 1, 32)
    _push(state, "w1", g, 1, 32)
    assert _push(state, "w2", g, 1, 32).applied and state.version == 2, "at the current model it counts"
