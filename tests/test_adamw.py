"""The Numba AdamW against torch.optim.AdamW, the LR schedule, and the clipping factor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatrain.host.adamw import OptimConfig, adamw_update, clip_scale, lr_at

N = 4099  # a few thousand elements, deliberately not a round number
STEPS = 20


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) / np.linalg.norm(b.astype(np.float64)))


def run_both(
    cfg: OptimConfig, weight_decay: float, grad_scale: float, foreach: bool, seed: int = 0, total_steps: int = STEPS
):
    """STEPS steps of ours and torch's AdamW on the same random parameters and gradients.

    Torch sees the gradient already multiplied by grad_scale; ours gets the raw gradient plus the scale.
    """
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay, foreach=foreach)
    p = p0.numpy().copy()
    m = np.zeros(N, np.float32)
    v = np.zeros(N, np.float32)
    for t in range(total_steps):
        g = torch.randn(N, generator=gen) * (0.5 + t % 3)  # varying magnitudes
        lr = lr_at(cfg, t, total_steps)
        ref.grad = g * grad_scale
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        g_np = g.numpy().copy()
        adamw_update(p, g_np, m, v, step=t + 1, lr=lr, cfg=cfg, weight_decay=weight_decay, grad_scale=grad_scale)
        np.testing.assert_array_equal(g_np, g.numpy())  # the gradient is read, never scaled in place
    state = opt.state[ref]
    return (p, m, v), (ref.detach().numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy())


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_scale", [1.0, 0.3])
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.8, 0.9)])
@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_matches_torch(weight_decay: float, grad_scale: float, betas: tuple[float, float], foreach: bool) -> None:
    cfg = OptimConfig(lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay, schedule="cosine", warmup_steps=3)
    ours, theirs = run_both(cfg, weight_decay, grad_scale, foreach)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, theirs):
        assert rel(a, b) < 1e-6, (name, rel(a, b))
    assert rel(ours[0], theirs[0]) < 1e-6


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.9999)])
def test_adamw_matches_torch_with_beta2_near_one(betas: tuple[float, float]) -> None:
    cfg = OptimConfig(lr=1e-2, betas=betas, eps=1e-8, weight_decay=0.1)
    ours, theirs = run_both(cfg, 0.1, 1.0, foreach=False)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, theirs):
        assert rel(a, b) < 1e-6, (name, rel(a, b))


def test_adamw_large_eps_makes_grad_scale_visible_in_params() -> None:
    # With a large eps the update is not scale-invariant, so a wrongly applied grad_scale shows in p.
    cfg = OptimConfig(lr=1e-2, eps=1e-1, weight_decay=0.05)
    ours, theirs = run_both(cfg, 0.05, 0.2, foreach=False)
    unscaled, _ = run_both(cfg, 0.05, 1.0, foreach=False)
    assert rel(ours[0], theirs[0]) < 1e-6
    assert rel(ours[0], unscaled[0]) > 1e-4


def test_weight_decay_and_grad_scale_take_effect() -> None:
    cfg = OptimConfig(lr=1e-2, schedule="constant")
    (p_nowd, m1, v1), _ = run_both(cfg, 0.0, 1.0, foreach=False)
    (p_wd, _, _), _ = run_both(cfg, 0.1, 1.0, foreach=False)
    (_, m_s, v_s), _ = run_both(cfg, 0.0, 0.3, foreach=False)
    assert rel(p_wd, p_nowd) > 1e-4
    np.testing.assert_allclose(m_s, 0.3 * m1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v_s, 0.09 * v1, rtol=1e-5, atol=1e-9)


def test_adamw_single_step_closed_form() -> None:
    # First step from zero moments: p <- p(1 - lr wd) - lr * g / (|g| + eps) elementwise.
    cfg = OptimConfig(lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    p = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    g = np.array([0.5, -0.25, 2.0, 0.0], np.float32)
    m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    want = p * (1 - 0.1 * 0.2) - 0.1 * g / (np.abs(g) + 1e-8)
    adamw_update(p, g, m, v, step=1, lr=0.1, cfg=cfg, weight_decay=0.2)
    np.testing.assert_allclose(p, want, rtol=1e-6)
    np.testing.assert_allclose(m, 0.1 * g, rtol=1e-6)
    np.testing.assert_allclose(v, 0.01 * g * g, rtol=1e-6)


# ---- LR schedule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_lr_over_warmup_to_lr(schedule: str) -> None:
    cfg = OptimConfig(lr=2e-3, schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    total = 20
    warm = [lr_at(cfg, t, total) for t in range(4)]
    assert warm == pytest.approx([2e-3 * (t + 1) / 4 for t in range(4)])
    assert warm[0] == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert warm[-1] == pytest.approx(cfg.lr)
    # The first step after warmup is at the peak.
    assert lr_at(cfg, 4, total) == pytest.approx(cfg.lr)


def test_constant_schedule() -> None:
    cfg = OptimConfig(lr=5e-4, schedule="constant", min_lr_ratio=0.1)
    assert [lr_at(cfg, t, 10) for t in range(12)] == pytest.approx([5e-4] * 12)


@pytest.mark.parametrize("warmup", [0, 5])
def test_linear_schedule(warmup: int) -> None:
    cfg = OptimConfig(lr=1e-3, schedule="linear", warmup_steps=warmup, min_lr_ratio=0.2)
    total = 25
    after = [lr_at(cfg, t, total) for t in range(warmup, total)]
    assert after[0] == pytest.approx(1e-3)
    assert after[-1] == pytest.approx(1e-3 * 0.2)
    steps = np.diff(after)
    assert np.allclose(steps, steps[0]) and steps[0] < 0  # a straight line down
    assert lr_at(cfg, total + 5, total) == pytest.approx(1e-3 * 0.2)  # clamps past the end


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_cosine_schedule(warmup: int, min_ratio: float) -> None:
    cfg = OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=warmup, min_lr_ratio=min_ratio)
    total = 23
    span = total - warmup - 1
    for t in range(warmup, total):
        frac = (t - warmup) / span
        want = 3e-3 * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        assert lr_at(cfg, t, total) == pytest.approx(want, rel=1e-12, abs=1e-15), t
    assert lr_at(cfg, warmup, total) == pytest.approx(cfg.lr)
    assert lr_at(cfg, total - 1, total) == pytest.approx(cfg.lr * min_ratio, abs=1e-15)
    mid = warmup + span / 2
    if mid == int(mid):
        assert lr_at(cfg, int(mid), total) == pytest.approx(cfg.lr * (1 + min_ratio) / 2)
    after = [lr_at(cfg, t, total) for t in range(warmup, total)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert min(after) >= cfg.lr * min_ratio - 1e-15


def test_schedule_with_a_single_step_after_warmup() -> None:
    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2)
    assert lr_at(cfg, 2, 3) == pytest.approx(1e-3)  # no division by zero
    cfg0 = OptimConfig(lr=1e-3, schedule="linear")
    assert lr_at(cfg0, 0, 1) == pytest.approx(1e-3)


# ---- clipping ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_norm", [1e-3, 0.5, 0.999999, 1.0, 2.0, 37.0])
@pytest.mark.parametrize("max_norm", [1.0, 0.25])
def test_clip_scale_equals_torch_clip_factor(target_norm: float, max_norm: float) -> None:
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((13, 7), (5,), (257,))]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    for p, g in zip(params, grads):
        p.grad = g * (target_norm / norm)
    before = [p.grad.clone() for p in params]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    factors = torch.cat([(p.grad / b).flatten() for p, b in zip(params, before)])
    factor = float(factors.mean())
    assert torch.allclose(factors, torch.full_like(factors, factor), rtol=1e-6)
    ours = clip_scale(float(total), max_norm)
    assert ours == pytest.approx(factor, rel=1e-6)
    assert ours <= 1.0


def test_clip_scale_disabled_and_bounds() -> None:
    assert clip_scale(123.0, 0.0) == 1.0
    assert clip_scale(0.0, 1.0) == 1.0
    assert clip_scale(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))


def test_fused_bf16_copy_equals_the_update_then_torchs_cast() -> None:
    """The resident-mode kernel: params, m and v bit-identical to the plain update, and the bf16 bits equal
    torch's cast of the new params (round to nearest even) at every magnitude, ties, subnormals, the
    largest finite values (which round to inf) and inf; a NaN stays a NaN."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    p = (rng.standard_normal(n) * np.exp(rng.uniform(-60, 60, n))).astype(np.float32)
    p[:8] = [0.0, -0.0, np.inf, -np.inf, 3.0e38, -3.39e38, 1e-40, -1e-42]
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3F807FFF], np.uint32).view(np.float32)
    p[8:13] = ties
    g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    g[:13] = m[:13] = v[:13] = 0.0  # the special values pass through unchanged (lr * 0 / eps)
    g[13] = np.nan  # a NaN weight after the update
    cfg = OptimConfig(lr=1e-3, weight_decay=0.0)
    plain = [x.copy() for x in (p, g, m, v)]
    adamw_update(plain[0], plain[1], plain[2], plain[3], step=3, lr=1e-3, cfg=cfg, weight_decay=0.0, grad_scale=0.5)
    out = np.zeros(n, np.uint16)
    fused = [x.copy() for x in (p, g, m, v)]
    adamw_update(
        fused[0], fused[1], fused[2], fused[3], step=3, lr=1e-3, cfg=cfg, weight_decay=0.0, grad_scale=0.5, bf16_out=out
    )
    for a, b in zip(plain, fused):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.isnan(fused[0][13])
    ref = torch.from_numpy(plain[0]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    finite = ~np.isnan(plain[0])
    assert np.array_equal(out[finite], ref[finite])
    assert torch.isnan(got[13]) and (~finite).sum() == 1


def test_bf16_gradients_are_widened_exactly_and_may_share_the_output() -> None:
    """Clipping with a resident copy: the gradient is read as bf16 bits from the tile that then receives the
    new weights. Same result as the fp32 gradient of the same values, and the tile ends as the new weights."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(N, generator=gen).numpy()
    m0, v0 = (torch.randn(N, generator=gen) * 0.1).numpy(), (torch.rand(N, generator=gen) * 0.01).numpy()
    g = torch.randn(N, generator=gen).bfloat16()
    wide = [a.copy() for a in (p0, m0, v0)]
    adamw_update(
        wide[0], g.float().numpy(), wide[1], wide[2], step=2, lr=cfg.lr, cfg=cfg, weight_decay=0.1, grad_scale=0.4
    )
    tile = g.view(torch.int16).numpy().view(np.uint16).copy()
    narrow = [a.copy() for a in (p0, m0, v0)]
    adamw_update(
        narrow[0],
        tile,
        narrow[1],
        narrow[2],
        step=2,
        lr=cfg.lr,
        cfg=cfg,
        weight_decay=0.1,
        grad_scale=0.4,
        bf16_out=tile,
    )
    for a, b in zip(wide, narrow):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        torch.from_numpy(tile.view(np.int16)).view(torch.bfloat16).float().numpy(),
        torch.from_numpy(wide[0]).bfloat16().float().numpy(),
    )
