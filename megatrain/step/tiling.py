"""Token-tiled layers: a decoder layer's position-wise half runs over tiles of tokens, so its transient
memory follows the tile, not the sequence.

At long context the MLP half of a layer dominates its activation memory: gate, up, the activation and
their product are `intermediate_size` wide per token (a 7B layer at 512K tokens: about 20 GB each in
bf16), where attention with a flash / memory-efficient kernel holds O(sequence · hidden). A tiled layer
runs `h + mlp(post_attention_layernorm(h))` tile by tile in its forward, keeps only its input `h` for
the backward, and there runs each tile's forward again with grad and its backward (the MLP's forward
FLOPs once more: at the lengths that need tiling, attention's quadratic cost dwarfs it).

The parameter gradients of the tiles are summed in fp32 and handed back once in the parameters' dtype,
so the result differs from the untiled layer only by the order of that sum (equal to 1e-6 in fp32,
tested against the HF layer). The attention half is the family's own module, unchanged.

Generic over the families whose decoder layer is `x + self_attn(input_layernorm(x))` followed by
`h + mlp(post_attention_layernorm(h))` (Llama, Qwen2, Mistral and their relatives): `tileable()` checks
that shape and the engine refuses a tile size for a layer that has another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.func import functional_call

PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
MLP_HALF = ("post_attention_layernorm.", "mlp.")


def tileable(layer: torch.nn.Module) -> bool:
    """Whether the layer has the pre-norm residual shape a tiled layer reproduces."""
    return all(isinstance(getattr(layer, p, None), torch.nn.Module) for p in PARTS)


def _sub(views: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: t for k, t in views.items() if k.startswith(prefix)}


class _TiledMlp(torch.autograd.Function):
    """out = x + mlp_half(x), computed `tile` tokens at a time; saves x only."""

    @staticmethod
    def forward(
        ctx, fn: Callable, names: Sequence[str], tile: int, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.fn, ctx.names, ctx.tile = fn, names, tile
        ctx.save_for_backward(x, *params)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        with torch.no_grad():
            for s in range(0, rows.shape[0], tile):
                xs = rows[s : s + tile]
                out[s : s + tile] = xs + fn(dict(zip(names, params)), xs)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        rows, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(rows)
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        for s in range(0, rows.shape[0], ctx.tile):
            with torch.enable_grad():
                xs = rows[s : s + ctx.tile].detach().requires_grad_(True)
                leaves = [p.detach().requires_grad_(True) for p in params]
                ys = ctx.fn(dict(zip(ctx.names, leaves)), xs)
                got = torch.autograd.grad(ys, [xs, *leaves], g[s : s + ctx.tile], allow_unused=True)
            grad_x[s : s + ctx.tile] = g[s : s + ctx.tile] + got[0]  # the residual's share, then the MLP's
            for acc, part in zip(sums, got[1:]):
                if part is not None:
                    acc += part
        return (None, None, None, grad_x.view(x.shape), *(a.to(p.dtype) for a, p in zip(sums, params)))


def tiled_layer(
    layer: torch.nn.Module,
    views: dict[str, torch.Tensor],
    x: torch.Tensor,
    tile: int,
    attn_kwargs: dict,
    attention: Callable | None = None,
) -> torch.Tensor:
    """The decoder layer's output for input x, its MLP half in tiles of `tile` tokens.

    `views`: the layer's tensors by HF name. `attention(fn, *args)` runs the attention half (the engine
    passes lean_call there, so a lean layer saves only its GEMM and attention outputs); the tiled half
    keeps its own recompute and is never under it."""
    names = [k for k in views if k.startswith(MLP_HALF)]
    norm, mlp = layer.post_attention_layernorm, layer.mlp

    def mlp_half(p: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        # As [1, tile, hidden]: the MoE blocks take [batch, seq, hidden]; GPT-OSS's also returns its router scores.
        normed = functional_call(norm, _sub(p, "post_attention_layernorm."), (xs,))
        out = functional_call(mlp, _sub(p, "mlp."), (normed.unsqueeze(0),))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)

    def attn_half(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        v = dict(zip(attn_names, tensors))
        normed = functional_call(layer.input_layernorm, _sub(v, "input_layernorm."), (x,))
        out = functional_call(layer.self_attn, _sub(v, "self_attn."), (), {"hidden_states": normed, **attn_kwargs})
        return x + (out[0] if isinstance(out, tuple) else out)

    attn_names = [k for k in views if not k.startswith(MLP_HALF)]
    run = attention or (lambda fn, *a: fn(*a))
    h = run(attn_half, x, *(views[k] for k in attn_names))
    return _TiledMlp.apply(mlp_half, names, tile, h, *(views[k] for k in names))
