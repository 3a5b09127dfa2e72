"""What the tests of engine.gpu_optimizer share (tests/test_gpu_optimizer.py, its CUDA twin): one AdamW step
done both ways on the same arrays, bit comparisons, and runs compared whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from megatrain.config.optim import OptimConfig
from megatrain.formats import checkpoint as ckpt
from megatrain.host.adamw import adamw_tensors, adamw_update
from tests.harness import LAYERS, final_weights, losses, planes, train_tiny

UNITS = LAYERS + 2  # the tiny models' units: embedding, layers, final norm and head
# A threshold among the tiny llama's gradient norms of its steps (1.3 to 1.8): some steps clip, some do not.
CLIPS_SOMETIMES = "optim.max_grad_norm=1.5"


def _arrays(n: int, seed: int) -> tuple[np.ndarray, ...]:
    """Weights, moments and a gradient with the values that round differently if an operation is fused or
    reordered: zeros, tiny and large second moments, gradients of both signs across magnitudes."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 10.0 ** rng.integers(-12, 0, n)).astype(np.float32)
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n)).astype(np.float32)
    m[:7], v[:7], g[7:14] = 0, 0, 0
    return p, m, v, g


def update_both_ways(
    n: int, seed: int, scale: float, wd: float, grad_dtype: torch.dtype, device: str
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """One AdamW step on the same arrays by the host's kernel and by adamw_tensors on `device`: (p, m, v, bf16
    bits) of each, as numpy arrays."""
    cfg = OptimConfig(betas=(0.9, 0.95), eps=1e-8)
    p, m, v, g = _arrays(n, seed)
    grad = torch.from_numpy(g).to(grad_dtype)
    host_g = grad.view(torch.int16).numpy().view(np.uint16) if grad_dtype == torch.bfloat16 else g
    tp, tm, tv = (torch.from_numpy(a.copy()).to(device) for a in (p, m, v))
    bits = np.zeros(n, np.uint16)
    adamw_update(p, host_g.copy(), m, v, step=3, lr=1e-3, cfg=cfg, weight_decay=wd, grad_scale=scale, bf16_out=bits)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    args = {"step": 3, "lr": 1e-3, "cfg": cfg, "weight_decay": wd, "grad_scale": scale, "out": out}
    adamw_tensors(tp, grad.to(device), tm, tv, **args)
    mine = (*(t.cpu().numpy() for t in (tp, tm, tv)), out.cpu().view(torch.int16).numpy().view(np.uint16))
    return (p, m, v, bits), mine


def same_bits(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    for name, x, y in zip(("params", "exp_avg", "exp_avg_sq", "bf16 copy"), a, b, strict=True):
        bits = np.uint16 if x.dtype == np.uint16 else np.uint32
        differ = int((x.view(bits) != y.view(bits)).sum())
        assert differ == 0, f"{name}: {differ} of {x.size} elements differ"


def run_held(out: Path, held: int, *extra: str, steps: int = 20) -> Path:
    train_tiny(out, "llama", "ipc.staging=resident", f"engine.gpu_optimizer={held}", *extra, steps=steps)
    return out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_run(a: Path, b: Path) -> None:
    la, lb = losses(a), losses(b)
    assert la == lb, {s: (la.get(s), lb.get(s)) for s in sorted(set(la) | set(lb)) if la.get(s) != lb.get(s)}
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    steps = [s for s, _ in ckpt.complete(a / "checkpoints")]
    assert steps and steps == [s for s, _ in ckpt.complete(b / "checkpoints")]
    for step in steps:
        assert planes(ckpt.step_dir(a / "checkpoints", step)) == planes(ckpt.step_dir(b / "checkpoints", step)), step
