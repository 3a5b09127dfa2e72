"""Our expert path for a mixture-of-experts layer, registered with transformers' ExpertsInterface as EXPERTS.

HF's router, a shared expert and the router statistics (megatrain/layers/moe.py) stay HF's modules; only the experts'
computation is ours. The routed rows are sorted by expert once per layer and that order serves the forward and
the backward. Each projection is one grouped GEMM over exactly the routed rows; the combine is a batched
matmul of each token's k rows with its routing weights, so no output is summed by atomics and two runs agree
bit for bit. The backward is written here (Experts): it keeps the gate/up output h and the routing only,
recomputes the activation from h, gathers the input rows again instead of keeping the gathered copy, never
needs the down output (the routing weights' gradient is taken as <g·W2ᵀ, a>), and reads no count on the host
wherever the grouped GEMM takes the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface

EXPERTS = "megatrain"  # the name config._experts_implementation takes for this path

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10


def _fits(t: torch.Tensor) -> bool:
    """grouped_mm's layout rules for one operand: its last two dims with one unit stride and the other a
    multiple of 16 bytes, and on CUDA a 16-byte aligned start (include/ATen/native/GroupedMMUtils.h)."""
    s, size = t.stride()[-2:], t.element_size()
    if 1 not in s or any(x != 1 and (x * size) % 16 for x in s):
        return False
    return t.device.type != "cuda" or t.data_ptr() % 16 == 0


def _grouped(a: torch.Tensor, b: torch.Tensor) -> bool:
    # On CUDA only bf16 has a fast grouped kernel; fp32 there would go through torch's own per-group loop,
    # whose presence differs across versions, so ours runs instead.
    if a.device.type == "cuda" and a.dtype != torch.bfloat16:
        return False
    return _fits(a) and _fits(b)


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matmul over row groups ending at offs (int32): a [S,K] x b [E,K,N] -> [S,N], or, for the
    weights' gradients, a [K,S] x b [S,N] -> [E,K,N] (group e's columns of a times its rows of b)."""
    if _grouped(a, b):
        return _grouped_mm(a, b, offs=offs)
    # A layout grouped_mm refuses (strides or start not 16-byte aligned, e.g. odd widths in bf16, or a weight
    # view at an unaligned offset of a flat vector) runs one matmul per expert: correct, but it reads the
    # group sizes on the host, which waits for the device.
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[-1])
        for e, (s0, s1) in enumerate(zip(starts, ends)):
            if s1 > s0:
                torch.mm(a[s0:s1], b[e], out=out[s0:s1])
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, (s0, s1) in enumerate(zip(starts, ends)):
        if s1 > s0:
            torch.mm(a[:, s0:s1], b[s0:s1], out=out[e])
    return out


def _segment_sum(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert sums of sorted rows (the biases' gradients), one ordered reduction per segment: no atomics.
    Summed in fp32: a segment holds thousands of rows, over which a bf16 running sum loses its low bits."""
    starts = torch.cat([offs.new_zeros(1), offs]).long()
    return torch.segment_reduce(rows.float(), "sum", offsets=starts, axis=0, unsafe=True, initial=0).to(rows.dtype)


# GPT-OSS's clamped GLU; gate and up interleaved in h. (alpha, limit) of its config, None for SwiGLU.
Clamp = tuple[float, float] | None


def activation(h: torch.Tensor, clamp: Clamp) -> torch.Tensor:
    if clamp is None:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    alpha, limit = clamp
    gate = h[:, ::2].clamp(max=limit)
    up = h[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def activation_backward(h: torch.Tensor, da: torch.Tensor, clamp: Clamp) -> torch.Tensor:
    """dL/dh from dL/da, recomputed from h (the activation's own tensors are not kept)."""
    if clamp is None:
        gate, up = h.chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        dgate = da * up * (s * (1 + gate * (1 - s)))
        return torch.cat([dgate, da * gate * s], dim=-1)
    alpha, limit = clamp
    gate, up = h[:, ::2], h[:, 1::2]
    g = gate.clamp(max=limit)
    s = torch.sigmoid(g * alpha)
    # the clamps pass the gradient where their input is within the bounds, ends included (torch's clamp)
    dup = da * (g * s) * ((up >= -limit) & (up <= limit))
    dgate = da * (up.clamp(min=-limit, max=limit) + 1) * (s + alpha * g * s * (1 - s)) * (gate <= limit)
    return torch.stack([dgate, dup], dim=-1).flatten(-2)


class Experts(torch.autograd.Function):
    """y[t] = Σ_j w[t,j] · down_e(act(gate_up_e(x[t]))), e = idx[t,j]. Weights in HF's stored layouts:
    gate_up [E,2I,H] and down [E,H,I], or with `transposed` [E,H,2I] and [E,I,H] (GPT-OSS, with biases)."""

    @staticmethod
    def forward(ctx, x, idx, w, gate_up, down, gate_up_bias, down_bias, clamp: Clamp, transposed: bool):
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: equal experts keep token order, runs agree
        eid = flat[order]
        # group ends from the sorted ids on the device: grouped_mm takes them without the host seeing a count
        offs = torch.searchsorted(eid, torch.arange(gate_up.shape[0], device=x.device), right=True, out_int32=True)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=x.device)
        w1 = gate_up if transposed else gate_up.transpose(1, 2)
        w2 = down if transposed else down.transpose(1, 2)
        h = gmm(x[order // k], w1, offs)
        if gate_up_bias is not None:
            h = h + gate_up_bias[eid]
        y = gmm(activation(h, clamp), w2, offs)
        if down_bias is not None:
            y = y + down_bias[eid]
        out = torch.bmm(w.to(y.dtype).unsqueeze(1), y[inv].view(T, k, -1)).squeeze(1)
        ctx.save_for_backward(x, h, order, inv, offs, w, gate_up, down, eid if down_bias is not None else None)
        ctx.down_bias, ctx.clamp, ctx.transposed = down_bias, clamp, transposed
        ctx.gate_up_bias = gate_up_bias is not None
        return out.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, h, order, inv, offs, w, gate_up, down, eid = ctx.saved_tensors
        T, k = w.shape
        transposed, clamp = ctx.transposed, ctx.clamp
        tok = order // k
        ws = w.reshape(-1)[order].to(h.dtype)[:, None]
        a = activation(h, clamp)
        gg = g[tok].contiguous()  # the output's gradient per routed row, before its routing weight
        dz = gmm(gg, down.transpose(1, 2) if transposed else down, offs)
        dw = (dz * a).sum(-1)  # <g, a·W2> without y
        if ctx.down_bias is not None:
            dw = dw + (gg * ctx.down_bias[eid]).sum(-1)
        ddown = gmm((a * ws).t(), gg, offs) if transposed else gmm(gg.t(), a * ws, offs)
        dbias2 = _segment_sum(gg * ws, offs) if ctx.down_bias is not None else None
        del a
        dh = activation_backward(h, dz * ws, clamp)
        del dz
        xg = x[tok]  # gathered again: cheaper than keeping k copies of the input per token
        dgate_up = gmm(xg.t(), dh, offs) if transposed else gmm(dh.t(), xg, offs)
        del xg
        dbias1 = _segment_sum(dh, offs) if ctx.gate_up_bias else None
        dxg = gmm(dh, gate_up.transpose(1, 2) if transposed else gate_up, offs)
        dx = dxg[inv].view(T, k, -1).sum(1)
        return dx.to(x.dtype), None, dw[inv].view(T, k).to(w.dtype), dgate_up, ddown, dbias1, dbias2, None, None


def runs(module: torch.nn.Module) -> bool:
    """Whether our path runs this experts module's activation: SwiGLU (SiLU) or GPT-OSS's clamped GLU."""
    return getattr(module, "limit", None) is not None or isinstance(
        getattr(module, "act_fn", None), SiLUActivation | torch.nn.SiLU
    )


def experts_forward(module: torch.nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """HF's experts forward (hidden_states [T,H], top-k ids and weights [T,k]) on our path."""
    biased = getattr(module, "has_bias", False)
    if not runs(module):  # the config check (megatrain/model/spec.py check_on_meta) stops such a run before it starts
        raise ValueError(f"{type(module).__name__}: engine.moe_experts=megatrain runs SwiGLU and GPT-OSS's GLU only")
    clamp: Clamp = (float(module.alpha), float(module.limit)) if getattr(module, "limit", None) is not None else None
    return Experts.apply(
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        module.gate_up_proj_bias if biased else None,
        module.down_proj_bias if biased else None,
        clamp,
        bool(getattr(module, "is_transposed", False)),
    )


ExpertsInterface.register(EXPERTS, experts_forward)
