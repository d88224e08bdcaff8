"""Update rules against plain torch: same gradients in, same parameters out."""

import pytest
import torch

from dynabatch.common.protocols import dbs_weight
from dynabatch.optim import SGD
from dynabatch.ps.aggregation import weighted_mean
from dynabatch.ps.protocol_rules import SyncRound
from dynabatch.ps.update_rules import sgd_step_


def _torch_reference(w0, grads, cfg, scales):
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD(
        [p], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
    )
    for g, s in zip(grads, scales, strict=True):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * s
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _ours(w0, grads, cfg, scales):
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g, s in zip(grads, scales, strict=True):
        sgd_step_(w, g, buf, cfg, s)
    return w


def test_sgd_matches_torch_for_every_option():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(20)]
    scales = [1.0, 0.5, 2.0, 1.5] * 5
    for cfg in (
        SGD(lr=0.1),
        SGD(lr=0.05, momentum=0.9),
        SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
        SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    ):
        torch.testing.assert_close(_ours(w0, grads, cfg, scales), _torch_reference(w0, grads, cfg, scales))


def test_runs_of_different_weight_decay_step_as_separate_tensors_would():
    """A chunk holding parameters with and without decay: each run steps as if it were a tensor of its own."""
    gen = torch.Generator().manual_seed(1)
    w0, g = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    cfg = SGD(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True)
    segments = [(0, 30, 0.1), (30, 45, 0.0), (45, 100, 0.1)]
    w, buf = w0.clone(), torch.zeros(100)
    for _ in range(3):
        sgd_step_(w, g, buf, cfg, 1.0, segments)
    for a, b, decay in segments:
        part = SGD(lr=0.1, momentum=0.9, weight_decay=decay, nesterov=True)
        torch.testing.assert_close(w[a:b], _ours(w0[a:b], [g[a:b]] * 3, part, [1.0] * 3))


def test_dbs_weight_is_one_for_even_split_and_proportional_otherwise():
    assert dbs_weight(64, 192, 3, "paper") == 1.0
    assert dbs_weight(128, 192, 3, "paper") == 2.0
    assert dbs_weight(32, 192, 3, "paper") == 0.5


def test_the_capped_dbs_weight_weighs_by_samples_and_never_amplifies():
    assert dbs_weight(64, 192, 3) == dbs_weight(64, 192, 3, "capped") == 1.0
    assert dbs_weight(128, 192, 3) == 1.0
    assert dbs_weight(32, 192, 3) == 0.5
    with pytest.raises(ValueError, match="unknown DBS weight rule 'big'"):
        dbs_weight(32, 192, 3, "big")


def test_sync_round_is_the_sample_weighted_mean():
    gen = torch.Generator().manual_seed(1)
    g1, g2 = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
    g1_before = g1.clone()
    r = SyncRound()
    r.add("w0", g1, 30)
    assert not r.complete({"w0", "w1"})
    r.add("w1", g2, 10)
    assert r.complete({"w0", "w1"})
    assert r.complete({"w0"})
    torch.testing.assert_close(weighted_mean(r.contributions()), (30 * g1 + 10 * g2) / 40)
    assert torch.equal(g1, g1_before), "the round must not accumulate into a received tensor"


def test_sync_round_refuses_a_second_push_from_one_worker():
    r = SyncRound()
    r.add("w0", torch.ones(3), 1)
    try:
        r.add("w0", torch.ones(3), 1)
    except ValueError as exc:
        assert "w0" in str(exc)
    else:
        raise AssertionError("duplicate push accepted")
    assert list(r.parts) == ["w0"]
