"""Update rules against plain torch: same gradients in, same parameters out."""

import pytest
import torch

from dynabatch.common.protocols import dbs_weight
from dynabatch.optim import SGD
from dynabatch.ps.aggregation import weighted_mean
from dynabatch.ps.protocol_rules import SyncRound
from dynabatch.ps.update_rules import sgd_step_


def _torch_reference(w0: torch.Tensor, grads: list[torch.Tensor], cfg: SGD, scales: list[float]) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    for g, s in zip(grads, scales, strict=True):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * s
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _ours(w0: torch.Tensor, grads: list[torch.Tensor], cfg: SGD, scales: list[float]) -> torch.Tensor:
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g, s in zip(grads, scales, strict=True):
        sgd_step_(w, g, buf, cfg, s)
    return w


def test_sgd_matches_torch_for_every_option() -> None:
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


def test_a_gradients_weight_scales_what_it_adds_to_momentum_as_torch_would_on_a_weighted_gradient() -> None:
    """weight w is torch's step on w * grad with weight decay w * decay; rate and momentum untouched."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(500, generator=gen)
    grads = [torch.randn(500, generator=gen) for _ in range(12)]
    weights = [1.0, 1 / 64, 0.5, 2.0] * 3
    for cfg in (SGD(lr=0.05, momentum=0.9, weight_decay=1e-3), SGD(lr=0.05, momentum=0.5, nesterov=True)):
        w, buf = w0.clone(), torch.zeros(500)
        p = torch.nn.Parameter(w0.clone())
        opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
        for g, weight in zip(grads, weights, strict=True):
            g_before = g.clone()
            sgd_step_(w, g, buf, cfg, 1.0, (), weight)
            assert torch.equal(g, g_before)  # a received gradient is never written
            opt.param_groups[0]["weight_decay"] = cfg.weight_decay * weight
            p.grad = g * weight
            opt.step()
        torch.testing.assert_close(w, p.detach())


def test_weight_one_is_the_unweighted_step_bit_for_bit() -> None:
    """b_i = B/n (every fixed-policy job without a capped worker): the same parameters and buffer as before."""
    gen = torch.Generator().manual_seed(3)
    w0, g = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    cfg = SGD(lr=0.05, momentum=0.5, weight_decay=1e-4)
    a, buf_a, b, buf_b = w0.clone(), torch.zeros(300), w0.clone(), torch.zeros(300)
    for _ in range(5):
        sgd_step_(a, g, buf_a, cfg, 0.7)
        sgd_step_(b, g, buf_b, cfg, 0.7, (), 1.0)
    assert torch.equal(a, b) and torch.equal(buf_a, buf_b)


@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_a_small_gradient_moves_the_model_by_its_share_whoever_steps_next(momentum: float) -> None:
    """The --max-batch 1 divergence (bench/RESULTS.md 9g): a gradient of weight w = b_i / (B/n) must move
    the parameters by lr * w / (1 - momentum) times itself in all, however many full-weight steps of other
    workers follow it. Scaling the rate instead kept the gradient in the buffer at full weight, and each
    following full-weight step applied it at full rate: lr * (w + momentum / (1 - momentum)) in all."""
    cfg = SGD(lr=0.05, momentum=momentum)
    g = torch.ones(10)
    w, buf = torch.zeros(10), torch.zeros(10)
    weight = dbs_weight(1, 192, 3)  # a 1-sample gradient among 3 workers of B = 192
    sgd_step_(w, g, buf, cfg, 1.0, (), weight)
    for _ in range(200):  # the other workers' steps (their gradients zero here, to see this one alone)
        sgd_step_(w, torch.zeros(10), buf, cfg, 1.0, (), 1.0)
    torch.testing.assert_close(w, -g * cfg.lr * weight / (1 - momentum))


def test_runs_of_different_weight_decay_step_as_separate_tensors_would() -> None:
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


def test_dbs_weight_is_one_for_even_split_and_proportional_otherwise() -> None:
    assert dbs_weight(64, 192, 3, "paper") == 1.0
    assert dbs_weight(128, 192, 3, "paper") == 2.0
    assert dbs_weight(32, 192, 3, "paper") == 0.5


def test_the_capped_dbs_weight_weighs_by_samples_and_never_amplifies() -> None:
    assert dbs_weight(64, 192, 3) == dbs_weight(64, 192, 3, "capped") == 1.0
    assert dbs_weight(128, 192, 3) == 1.0
    assert dbs_weight(32, 192, 3) == 0.5
    with pytest.raises(ValueError, match="unknown DBS weight rule 'big'"):
        dbs_weight(32, 192, 3, "big")


def test_sync_round_is_the_sample_weighted_mean() -> None:
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


def test_sync_round_refuses_a_second_push_from_one_worker() -> None:
    r = SyncRound()
    r.add("w0", torch.ones(3), 1)
    try:
        r.add("w0", torch.ones(3), 1)
    except ValueError as exc:
        assert "w0" in str(exc)
    else:
        raise AssertionError("duplicate push accepted")
    assert list(r.parts) == ["w0"]
