"""The shard's protocols against a plain-torch reference, and its checkpoints."""

from __future__ import annotations

import pytest
import torch

from dynabatch.common.chunking import make_layout
from dynabatch.common.wire import ProtocolError
from dynabatch.ps.checkpoint import load_checkpoint, save_checkpoint
from dynabatch.ps.shard_state import ShardState
from dynabatch.ps.update_rules import SGDConfig

SGD = SGDConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=False)
B = 96


def _state(protocol: str, total: int = 1000, chunk_bytes: int = 1024) -> tuple[ShardState, torch.Tensor]:
    flat = torch.randn(total, generator=torch.Generator().manual_seed(3))
    layout = make_layout(total, chunk_bytes, 1)
    state = ShardState.initial(layout.chunks, flat, SGD, protocol, B)
    state.set_live({"w0", "w1", "w2"})
    return state, flat


def _split(state: ShardState, g: torch.Tensor) -> dict[int, torch.Tensor]:
    return {c.id: g[c.start : c.stop] for c in state.chunks}


def _flat(state: ShardState) -> torch.Tensor:
    return torch.cat([state.params[c.id] for c in state.chunks])


def _reference(w0: torch.Tensor, steps: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=SGD.lr, momentum=SGD.momentum, weight_decay=SGD.weight_decay)
    for g, scale in steps:
        opt.param_groups[0]["lr"] = SGD.lr * scale
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_asgd_applies_each_gradient_on_arrival_weighted_by_its_batch():
    state, w0 = _state("asgd")
    gen = torch.Generator().manual_seed(0)
    pushes = [("w0", 64), ("w1", 22), ("w2", 10), ("w0", 64), ("w2", 10)]
    steps = []
    for i, (worker, samples) in enumerate(pushes):
        g = torch.randn(1000, generator=gen)
        out = state.push(worker, _split(state, g), base_version=max(0, i - 1), samples=samples, now=0.0)
        assert out.applied and out.version == i + 1
        assert out.staleness == (1 if i > 0 else 0)
        steps.append((g, samples * 3 / B))
    torch.testing.assert_close(_flat(state), _reference(w0, steps))
    assert set(state.chunk_versions.values()) == {5}


def test_ssgd_waits_for_every_live_worker_then_applies_the_sample_weighted_mean():
    state, w0 = _state("ssgd")
    gen = torch.Generator().manual_seed(1)
    grads = {w: torch.randn(1000, generator=gen) for w in ("w0", "w1", "w2")}
    samples = {"w0": 64, "w1": 22, "w2": 10}
    assert not state.push("w0", _split(state, grads["w0"]), 0, 64, 0.0).applied
    assert not state.push("w1", _split(state, grads["w1"]), 0, 22, 0.1).applied
    assert state.version == 0 and torch.equal(_flat(state), w0)
    out = state.push("w2", _split(state, grads["w2"]), 0, 10, 0.2)
    assert out.applied and out.version == 1
    mean = sum(samples[w] * grads[w] for w in grads) / sum(samples.values())
    torch.testing.assert_close(_flat(state), _reference(w0, [(mean, 1.0)]))


def test_ssgd_round_closes_when_the_missing_worker_leaves():
    state, w0 = _state("ssgd")
    g = torch.ones(1000)
    state.push("w0", _split(state, g), 0, 32, 0.0)
    state.push("w1", _split(state, 2 * g), 0, 32, 0.0)
    assert state.version == 0
    assert state.set_live({"w0", "w1"})
    assert state.version == 1
    torch.testing.assert_close(_flat(state), _reference(w0, [(1.5 * g, 1.0)]))


def test_ssgd_round_timeout_applies_what_arrived():
    state, w0 = _state("ssgd")
    state.push("w0", _split(state, torch.ones(1000)), 0, 32, now=10.0)
    assert not state.round_overdue(14.0, 5.0)
    assert state.round_overdue(15.5, 5.0)
    assert state.close_round() and state.version == 1
    assert not state.round_overdue(100.0, 5.0)


def test_ssgd_refuses_a_second_push_in_one_round():
    state, _ = _state("ssgd")
    state.push("w0", _split(state, torch.ones(1000)), 0, 32, 0.0)
    with pytest.raises(ProtocolError, match="bad_state"):
        state.push("w0", _split(state, torch.ones(1000)), 0, 32, 0.0)


def test_unknown_workers_and_bad_sample_counts_change_nothing():
    state, w0 = _state("asgd")
    with pytest.raises(ProtocolError, match="unknown_sender"):
        state.push("w9", _split(state, torch.ones(1000)), 0, 32, 0.0)
    with pytest.raises(ProtocolError, match="bad_field"):
        state.push("w0", _split(state, torch.ones(1000)), 0, 0, 0.0)
    assert state.version == 0 and torch.equal(_flat(state), w0)


def test_pull_gives_all_chunks_in_priority_order_or_refuses_unknown_ids():
    state, w0 = _state("asgd")
    items = state.pull([])
    assert [cid for cid, _, _ in items] == sorted(c.id for c in state.chunks)
    torch.testing.assert_close(torch.cat([t for _, t, _ in items]), w0)
    with pytest.raises(ProtocolError, match="unknown_chunk"):
        state.pull([999])


def test_checkpoint_round_trip_restores_version_parameters_and_momentum(tmp_path):
    state, _ = _state("asgd")
    for i in range(3):
        state.push("w0", _split(state, torch.full((1000,), float(i + 1))), i, 32, 0.0)
    meta = {"job": "j", "shard": 0, "total": 1000}
    path = tmp_path / "shard-0.pt"
    save_checkpoint(path, meta, state.snapshot())
    assert [p.name for p in tmp_path.iterdir()] == ["shard-0.pt"], "no temporary file may be left behind"
    fresh, _ = _state("asgd")
    fresh.restore(load_checkpoint(path, meta))
    assert fresh.version == 3
    for c in state.chunks:
        assert torch.equal(fresh.params[c.id], state.params[c.id])
        assert torch.equal(fresh.momentum[c.id], state.momentum[c.id])
    with pytest.raises(ValueError, match="written for"):
        load_checkpoint(path, {**meta, "shard": 1})
    assert load_checkpoint(tmp_path / "absent.pt", meta) is None


def test_restore_refuses_a_checkpoint_of_another_layout(tmp_path):
    state, _ = _state("asgd", total=1000)
    other, _ = _state("asgd", total=500)
    with pytest.raises(ValueError, match="different chunks"):
        other.restore(state.snapshot())
