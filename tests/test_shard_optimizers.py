"""The shards' optimizers against single-process torch: Adam, AdamW and SGD with `no_decay` groups,
one step per B samples for adaptive optimizers under asynchronous protocols, checkpoints, bad specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dynabatch import optim
from dynabatch.common.base_lr import base_lr
from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import ProtocolSettings, SoftsyncSettings
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.checkpoint import load_checkpoint, save_checkpoint
from dynabatch.ps.shard_state import ShardState
from dynabatch.ps.update_rules import chunk_segments, decay_runs, optimizer_spec

B = 192
NO_DECAY = ("bias", "norm.")
SPECS = [
    optim.AdamW(lr=0.01, weight_decay=0.1, no_decay=NO_DECAY),
    optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, no_decay=NO_DECAY),
    optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, no_decay=NO_DECAY),
]
GRADIENT_PROTOCOLS = ["asgd", "ssgd", "ssp", "softsync"]


class Net(nn.Module):
    """Weights with decay, biases and a norm without: the groups cut across chunk boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _named_sizes(model: nn.Module) -> list[tuple[str, int]]:
    return [(name, p.numel()) for name, p in model.named_parameters()]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _shards(
    spec: optim.OptimizerSpec,
    protocol: str,
    workers: int = 1,
    shards: int = 2,
    settings: ProtocolSettings | None = None,
) -> list[ShardState]:
    """The model's chunks held by `shards` shards (chunks of 256 values: about a dozen), `workers` live."""
    model = _net()
    flat = _flat(model)
    layout = make_layout(flat.numel(), 1024, shards)
    states = []
    for s in range(shards):
        state = ShardState.initial(layout.for_shard(s), flat, spec, protocol, B, settings, _named_sizes(model))
        state.set_membership({f"w{i}" for i in range(workers)}, allocated=workers)
        states.append(state)
    return states


def _push(states: list[ShardState], worker: str, g: torch.Tensor, samples: int) -> bool:
    """Every chunk of gradient `g` to its shard; True if every chunk was updated now."""
    applied = []
    for state in states:
        chunks = {c.id: g[c.start : c.stop] for c in state.chunks}
        out = state.push(worker, chunks, {cid: state.chunk_versions[cid] for cid in chunks}, samples, "grad", 0.0)
        applied.append(len(out.applied) == len(chunks))
    assert len(set(applied)) == 1, "every chunk steps together"
    return applied[0]


def _params(states: list[ShardState]) -> torch.Tensor:
    pieces = sorted((c.start, state.params[c.id]) for state in states for c in state.chunks)
    return torch.cat([p for _, p in pieces])


def _torch_optimizer(spec: optim.OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The single-process reference: torch's optimizer with the task's two parameter groups."""
    decay = [p for n, p in model.named_parameters() if not any(s in n for s in spec.no_decay)]
    no_decay = [p for n, p in model.named_parameters() if any(s in n for s in spec.no_decay)]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if isinstance(spec, optim.SGD):
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)
    assert isinstance(spec, optim.Adam), spec
    cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Tensor, lr: float) -> None:
    offset = 0
    for p in model.parameters():
        p.grad = g[offset : offset + p.numel()].reshape(p.shape).clone()
        offset += p.numel()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def _grads(n: int, total: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, generator=gen) for _ in range(n)]


def test_groups_follow_no_decay_across_chunk_boundaries() -> None:
    spec = optim.AdamW(weight_decay=0.1, no_decay=NO_DECAY)
    runs = decay_runs(_named_sizes(_net()), spec)
    # fc1.weight | fc1.bias norm.weight norm.bias (merged: one decay) | fc2.weight | fc2.bias
    assert runs == [(0, 2048, 0.1), (2048, 2240, 0.0), (2240, 2752, 0.1), (2752, 2760, 0.0)]
    assert chunk_segments(runs, 2048, 2304) == [(0, 192, 0.0), (192, 256, 0.1)]
    assert chunk_segments(runs, 2560, 2760) == [(0, 192, 0.1), (192, 200, 0.0)]
    assert chunk_segments(runs, 256, 512) == [(0, 256, 0.1)]


@pytest.mark.parametrize("protocol", GRADIENT_PROTOCOLS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_one_worker_pushing_batches_of_b_equals_single_process_torch(spec: optim.OptimizerSpec, protocol: str) -> None:
    """Each push of B samples is one step of torch's own optimizer with the task's groups, and the
    schedule's factor scales the rate of each; two shards hold the chunks between them."""
    states = _shards(spec, protocol)
    model = _net()
    opt = _torch_optimizer(spec, model)
    factors = [1.0, 0.5, 1.0, 0.25, 0.8, 1.0]
    for g, factor in zip(_grads(len(factors), _flat(model).numel()), factors, strict=True):
        for state in states:
            state.follow_job(0.0, factor)
        assert _push(states, "w0", g, B)
        _reference_step(model, opt, g, spec.lr * factor)
    assert all(state.version == len(factors) for state in states)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("protocol", ["asgd", "ssp"])
@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.name)
def test_adaptive_optimizers_under_asynchrony_step_once_per_b_samples_on_their_weighted_mean(
    spec: optim.OptimizerSpec, protocol: str
) -> None:
    states = _shards(spec, protocol, workers=3)
    model = _net()
    w0 = _flat(model)
    opt = _torch_optimizer(spec, model)
    grads = _grads(6, w0.numel(), seed=1)
    assert not _push(states, "w0", grads[0], 64)
    assert not _push(states, "w1", grads[1], 64)
    assert states[0].version == 0 and torch.equal(_params(states), w0), "nothing moves before B samples are in"
    assert _push(states, "w2", grads[2], 64)
    _reference_step(model, opt, (grads[0] + grads[1] + grads[2]) / 3, spec.lr)
    assert all(state.version == 1 for state in states)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)
    # Unequal batches: 120 + 30 + 42 = B, weighted by samples.
    assert not _push(states, "w0", grads[3], 120)
    assert not _push(states, "w1", grads[4], 30)
    assert _push(states, "w2", grads[5], 42)
    _reference_step(model, opt, (120 * grads[3] + 30 * grads[4] + 42 * grads[5]) / B, spec.lr)
    assert all(state.version == 2 for state in states)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)


def test_a_step_that_overshoots_b_takes_the_mean_of_every_sample_in_it() -> None:
    spec = SPECS[0]
    states = _shards(spec, "asgd", workers=2)
    model = _net()
    opt = _torch_optimizer(spec, model)
    g = _grads(2, _flat(model).numel(), seed=2)
    assert not _push(states, "w0", g[0], 150)
    assert _push(states, "w1", g[1], 100)
    _reference_step(model, opt, (150 * g[0] + 100 * g[1]) / 250, spec.lr)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)


def test_under_ssgd_a_round_of_unequal_batches_is_one_adaptive_step() -> None:
    spec = SPECS[0]
    states = _shards(spec, "ssgd", workers=2)
    model = _net()
    opt = _torch_optimizer(spec, model)
    g = _grads(2, _flat(model).numel(), seed=3)
    assert not _push(states, "w0", g[0], 30)
    assert _push(states, "w1", g[1], 10), "a round is one step, whatever its samples add up to"
    _reference_step(model, opt, (30 * g[0] + 10 * g[1]) / 40, spec.lr)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)


def test_softsync_rounds_count_their_samples_towards_b() -> None:
    """2-softsync with four workers closes a round per two gradients; an adaptive step waits for B samples."""
    spec = SPECS[0]
    states = _shards(spec, "softsync", workers=4, settings=SoftsyncSettings(2))
    model = _net()
    opt = _torch_optimizer(spec, model)
    g = _grads(4, _flat(model).numel(), seed=4)
    assert not _push(states, "w0", g[0], 48)
    assert not _push(states, "w1", g[1], 48), "a round of 96 samples closes, but B is 192"
    assert not _push(states, "w2", g[2], 48)
    assert _push(states, "w3", g[3], 48)
    mean = sum(g) / 4
    assert isinstance(mean, torch.Tensor)
    _reference_step(model, opt, mean, spec.lr)
    torch.testing.assert_close(_params(states), _flat(model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_restored_shard_takes_the_same_next_step_as_the_uninterrupted_one(
    tmp_path: Path, spec: optim.OptimizerSpec
) -> None:
    """The checkpoint holds the optimizer's state and the samples still waiting for a step."""
    [state] = _shards(spec, "asgd", workers=2, shards=1)
    grads = _grads(6, _flat(_net()).numel(), seed=5)
    for i, g in enumerate(grads[:3]):
        _push([state], f"w{i % 2}", g, 96)
    assert state.version == (3 if spec.name == "sgd" else 1), "adaptive: a step per B = 2 x 96 samples"
    meta = {"job": "j", "shard": 0}
    save_checkpoint(tmp_path / "shard-0.pt", meta, state.snapshot())
    [fresh] = _shards(spec, "asgd", workers=2, shards=1)
    saved = load_checkpoint(tmp_path / "shard-0.pt", meta)
    assert saved is not None
    fresh.restore(saved)
    for i, g in enumerate(grads[3:]):
        assert _push([state], f"w{i % 2}", g, 96) == _push([fresh], f"w{i % 2}", g, 96)
    assert fresh.version == state.version
    assert torch.equal(_params([fresh]), _params([state]))


JOB = JobConfig()


@pytest.mark.parametrize(
    "fields, names",
    [
        ({"name": "lion", "lr": 0.01}, "'lion' is not applied"),
        ({"name": "adamw", "lr": -0.01}, "lr must be a finite non-negative number"),
        ({"name": "adam", "lr": "fast"}, "lr must be"),
        ({"name": "adam", "lr": True}, "lr must be"),
        ({"name": "adamw", "lr": 1e-3, "betas": [0.9, 1.0]}, "betas must lie in [0, 1)"),
        ({"name": "adamw", "lr": 1e-3, "betas": [-0.1, 0.9]}, "betas must be"),
        ({"name": "adamw", "lr": 1e-3, "betas": [0.9]}, "betas must be two numbers"),
        ({"name": "adam", "lr": 1e-3, "eps": 0.0}, "eps must be positive"),
        ({"name": "adam", "lr": 1e-3, "weight_decay": float("nan")}, "weight_decay must be"),
        ({"name": "adam", "lr": 1e-3, "momentum": 0.9}, "unknown fields ['momentum']"),
        ({"name": "sgd", "lr": 0.1, "nesterov": "yes"}, "nesterov must be true or false"),
        ({"name": "sgd", "lr": 0.1, "momentum": 1.5}, "momentum must lie in [0, 1)"),
        ({"name": "sgd", "lr": 0.1, "no_decay": "bias"}, "no_decay must be a list"),
        (["sgd", 0.1], "a map of fields"),
    ],
)
def test_a_malformed_spec_from_a_peer_is_refused_naming_the_field(fields: Any, names: str) -> None:  # as a peer sends
    with pytest.raises(ProtocolError, match="bad_field") as refused:
        optimizer_spec(JOB, fields)
    assert names in refused.value.text, refused.value.text


def test_a_spec_is_checked_where_it_is_written_and_takes_keywords_only() -> None:
    """A momentum of 1.5 diverged through three rollbacks before the shards' check could say why; `SGD(0.1)` named
    the optimizer 0.1, refused only by the shards."""
    with pytest.raises(ValueError, match="momentum must lie in"):
        optim.SGD(lr=0.1, momentum=1.5)
    with pytest.raises(ValueError, match="lr must be"):
        optim.Adam(lr="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positional"):
        optim.SGD(0.1)  # type: ignore[call-arg, arg-type]


def test_the_wire_form_of_every_spec_is_accepted_back_and_no_spec_means_the_jobs_sgd() -> None:
    for spec in (*SPECS, optim.SGD(), optim.Adam(), optim.AdamW()):
        assert optimizer_spec(JOB, spec.to_wire()) == spec
    assert optimizer_spec(JOB, {}) == optim.SGD(
        lr=base_lr(JOB), momentum=JOB.momentum, weight_decay=JOB.weight_decay, nesterov=JOB.nesterov
    )
