"""The executor's warm-up: one decoder layer and one loss chunk, forward and backward, on random weights at the
run's shapes, while the store is still being filled.

The first step otherwise pays for every first time inside the layer loop: cuBLAS and cuDNN handles and
workspaces, the attention kernels' set-up, the allocator mapping its first gigabytes. On the H200 the first
step of the 7.6B shape took 10.6-11.4 s against 7.0 steady, its first layer 1.3 s against 0.06. The weights
here are throwaway (nothing is read from or written to the store), and the memory is handed back to the
caching allocator, which the step then reuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.layers.documents import layer_context
from megatrain.step.engine import StepEngine


def warm_up(engine: StepEngine, rows: int, seq: int) -> None:
    """Run a layer of `rows` sequences of `seq` tokens (the step's chunk) and a loss chunk, with grad, as
    the step will (token tiles and lean layers included), on the engine's device, then free it all."""
    t, cfg, dev, dtype = engine.t, engine.cfg, engine.device, engine.dtype
    hidden = engine.spec.hf_config.hidden_size
    layer = _random_unit(engine, 1)
    x = torch.randn(rows, seq, hidden, device=dev, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        ctx = layer_context(t.rotary, x, None, None)
    for lean in {False, cfg.lean_layers > 0}:
        out = t.layer(1, layer, x, ctx, lean=lean)
        torch.autograd.backward(out, torch.ones_like(out))
        del out
    head = _random_unit(engine, engine.n + 1)
    emb = _random_unit(engine, 0) if engine.spec.layout.tied else None
    tokens = min(rows * seq, cfg.loss_chunk_tokens)
    xc = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    logits = t.head(head, emb, xc)
    target = torch.randint(0, logits.shape[-1], (tokens,), device=dev)
    F.cross_entropy(logits.float(), target).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _random_unit(engine: StepEngine, unit: int) -> torch.Tensor:
    """A unit's flat weights, small and random (a norm's weight of ~0 only changes the numbers, not the
    kernels), in the compute dtype, requiring grad like the step's."""
    n = engine.spec.layout.structure_of(unit).numel
    w = torch.randn(n, device=engine.device, dtype=engine.dtype) * 0.02
    return w.requires_grad_(True)
