"""AdamW on the CPU: one fused Numba pass over a unit's tile, plus the LR schedule.

The arithmetic mirrors torch.optim.AdamW (single-tensor path) operation by operation in fp32, so
the two agree to rounding: decoupled decay p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g^2;
p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). Global-norm clipping enters as a gradient scale.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from megatrain.config.optim import OptimConfig as OptimConfig  # the optim section, re-exported


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based) of `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total_steps - cfg.warmup_steps - 1, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    shape = 1 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def clip_scale(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@intrinsic
def _f32_from_bf16(typingctx, bits):  # pragma: no cover - compiled
    """The float32 of the bfloat16 whose bit pattern is the uint16 `bits`: its bits in the upper half of a
    float32's (exact; a shift and a register move)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(wide, context.get_value_type(types.float32))

    return types.float32(types.uint16), codegen


def _grad_at(g, i):  # pragma: no cover - replaced by the overload below in compiled code
    raise NotImplementedError


@overload(_grad_at, inline="always")
def _grad_at_impl(g, i):  # pragma: no cover - compiled
    """g[i] as float32: fp32 gradients as they are, bf16 ones (uint16 bits, a resident tile holding the
    gradient) widened exactly, so Adam reads the compute dtype without a widened copy in memory."""
    if g.dtype == types.uint16:
        return lambda g, i: _f32_from_bf16(g[i])
    return lambda g, i: g[i]


@numba.njit(inline="always")
def _moments(g, m, v, i, w1, b2, w2, gscale):  # pragma: no cover - compiled
    """Element i's new moments: m + w1 (g - m) and v b2 + (w2 g) g, g scaled by the clip scale."""
    gi = _grad_at(g, i) * gscale
    return m[i] + w1 * (gi - m[i]), v[i] * b2 + w2 * gi * gi


@numba.njit(inline="always")
def _weight(p, mi, vi, decay, step, bc2_sqrt, eps):  # pragma: no cover - compiled
    """An element's new weight from its old one and its new moments."""
    return p * decay - step * (mi / (np.sqrt(vi) / bc2_sqrt + eps))


@numba.njit(inline="always")
def _bf16(p, bits):  # pragma: no cover - compiled
    """The bfloat16 bits of the fp32 `p` whose bits are `bits`: torch's rounding (c10::BFloat16), to nearest
    even, any NaN to the quiet NaN 0x7FC0."""
    if p != p:
        return np.uint16(0x7FC0)
    u = np.uint64(bits)
    return np.uint16((u + ((u >> np.uint64(16)) & np.uint64(1)) + np.uint64(0x7FFF)) >> np.uint64(16))


@numba.njit(parallel=True, cache=True, nogil=True)
def _adamw(p, g, m, v, decay, w1, b2, w2, step, bc2_sqrt, eps, gscale):  # pragma: no cover - compiled
    for i in numba.prange(p.size):
        mi, vi = _moments(g, m, v, i, w1, b2, w2, gscale)
        m[i] = mi
        v[i] = vi
        p[i] = _weight(p[i], mi, vi, decay, step, bc2_sqrt, eps)


@numba.njit(parallel=True, cache=True, nogil=True)
def _adamw_bf16(p, pbits, out, g, m, v, decay, w1, b2, w2, step, bc2_sqrt, eps, gscale):  # pragma: no cover
    """_adamw, and the new weight's bfloat16 bits into `out` in the same pass (the resident copy): one read
    of p instead of two. `pbits` is p viewed as uint32. `out` may be `g` itself (bf16 gradients waiting in the
    resident copy): element i of g is read before element i of out is written."""
    for i in numba.prange(p.size):
        mi, vi = _moments(g, m, v, i, w1, b2, w2, gscale)
        m[i] = mi
        v[i] = vi
        pi = _weight(p[i], mi, vi, decay, step, bc2_sqrt, eps)
        p[i] = pi
        out[i] = _bf16(pi, pbits[i])


@numba.njit(parallel=True, cache=True, nogil=True)
def _adamw_into(p, g, m, v, p2, m2, v2, decay, w1, b2, w2, step, bc2_sqrt, eps, gscale):  # pragma: no cover
    """_adamw with the new state written to (p2, m2, v2), the inputs left as they were (a speculative update
    into a spare slot): the same operations, so the same bits."""
    for i in numba.prange(p.size):
        mi, vi = _moments(g, m, v, i, w1, b2, w2, gscale)
        m2[i] = mi
        v2[i] = vi
        p2[i] = _weight(p[i], mi, vi, decay, step, bc2_sqrt, eps)


@numba.njit(parallel=True, cache=True, nogil=True)
def _adamw_bf16_into(
    p, g, m, v, p2, p2bits, m2, v2, out, decay, w1, b2, w2, step, bc2_sqrt, eps, gscale
):  # pragma: no cover
    """_adamw_bf16 into (p2, m2, v2) and `out` (p2bits: p2 viewed as uint32), the inputs left as they were."""
    for i in numba.prange(p.size):
        mi, vi = _moments(g, m, v, i, w1, b2, w2, gscale)
        m2[i] = mi
        v2[i] = vi
        pi = _weight(p[i], mi, vi, decay, step, bc2_sqrt, eps)
        p2[i] = pi
        out[i] = _bf16(pi, p2bits[i])


def adamw_scalars(
    *, step: int, lr: float, cfg: OptimConfig, weight_decay: float, grad_scale: float = 1.0
) -> tuple[np.float32, ...]:
    """The kernel's scalars (decay, 1-b1, b2, 1-b2, lr/bc1, sqrt(bc2), eps, the clip scale), formed in double and
    rounded once to fp32, as torch does (1 - b2 computed in fp32 from an fp32 b2 would be off by 1e-5 relative
    for b2 = 0.999)."""
    f = np.float32
    b1, b2 = cfg.betas
    return (
        f(1 - lr * weight_decay),
        f(1 - b1),
        f(b2),
        f(1 - b2),
        f(lr / (1 - b1**step)),
        f(math.sqrt(1 - b2**step)),
        f(cfg.eps),
        f(grad_scale),
    )


def adamw_update(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    *,
    step: int,
    lr: float,
    cfg: OptimConfig,
    weight_decay: float,
    grad_scale: float = 1.0,
    bf16_out: np.ndarray | None = None,
    into: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> None:
    """One AdamW step in place over fp32 arrays; `step` is 1-based (bias correction). `g` is fp32, or bf16 as
    uint16 bits. `bf16_out` (uint16, p's size): also write the new weights there as bfloat16 bits, in the
    same pass (it may be `g` itself). `into`: (p, m, v) of the new state instead, the old left unchanged (they
    must not overlap it, nor `g`). The scalars are adamw_scalars'.
    """
    scalars = adamw_scalars(step=step, lr=lr, cfg=cfg, weight_decay=weight_decay, grad_scale=grad_scale)
    if into is not None:
        p2, m2, v2 = into
        if bf16_out is None:
            _adamw_into(p, g, m, v, p2, m2, v2, *scalars)
        else:
            _adamw_bf16_into(p, g, m, v, p2, p2.view(np.uint32), m2, v2, bf16_out, *scalars)
    elif bf16_out is None:
        _adamw(p, g, m, v, *scalars)
    else:
        _adamw_bf16(p, p.view(np.uint32), bf16_out, g, m, v, *scalars)


# Elements of a unit updated at once on a device (adamw_tensors): its two fp32 scratch vectors, 256 MiB each.
TENSOR_CHUNK = 64 << 20


def adamw_tensors(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    step: int,
    lr: float,
    cfg: OptimConfig,
    weight_decay: float,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """adamw_update on torch tensors of any device (the units whose optimizer the GPU holds), bit for bit the
    Numba kernel's result: the same IEEE fp32 operations in the same order, each its own elementwise kernel, so
    no multiply-add is fused (a fused kernel, torch's own AdamW among them, rounds differently). Two of torch's
    kernels are not IEEE's and are avoided: CUDA divides by a host scalar as a multiply by its reciprocal (the
    divisor here is a device tensor), and the CPU's vectorized fp32 sqrt is off by an ulp at times (there it is
    taken in fp64 and rounded once: exact for a square root). `g` in any float dtype (read exactly as fp32);
    `out`: the new weights also cast there (to its dtype, rounding to nearest even, as the kernel's bf16 copy)."""
    scalars = adamw_scalars(step=step, lr=lr, cfg=cfg, weight_decay=weight_decay, grad_scale=grad_scale)
    decay, w1, b2, w2, step_size, _, eps, gscale = (float(x) for x in scalars)
    bc2_sqrt = torch.tensor(float(scalars[5]), dtype=torch.float32, device=p.device)
    for lo in range(0, p.numel(), TENSOR_CHUNK):
        sl = slice(lo, min(lo + TENSOR_CHUNK, p.numel()))
        pc, mc, vc = p[sl], m[sl], v[sl]
        gi = g[sl].float()
        if gscale != 1.0:  # x * 1.0 is x: skipped, not rounded differently
            gi = gi * gscale
        t = gi - mc  # m + w1 * (g - m)
        t.mul_(w1)
        mc.add_(t)
        vc.mul_(b2)  # v * b2 + (w2 * g) * g
        torch.mul(gi, w2, out=t)
        t.mul_(gi)
        vc.add_(t)
        del gi
        _ieee_sqrt(vc, t)  # p * decay - step_size * (m / (sqrt(v) / bc2_sqrt + eps))
        t.div_(bc2_sqrt)
        t.add_(eps)
        torch.div(mc, t, out=t)
        t.mul_(step_size)
        if decay != 1.0:
            pc.mul_(decay)
        pc.sub_(t)
        if out is not None:
            out[sl].copy_(pc)


def _ieee_sqrt(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = the correctly rounded fp32 square root of x."""
    if x.device.type == "cuda":
        torch.sqrt(x, out=out)
    else:
        out.copy_(torch.sqrt(x.double()))
