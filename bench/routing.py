"""--routing uniform: the bench's model with every MoE router balanced at init, as a save_pretrained directory
that MegaTrain (model.pretrained) and every peer (from_pretrained) start from, so they train the same model.

HF's random init routes the bench's tokens unevenly, more so with depth: a router's input has a component
common to every token (the arithmetic data has few distinct tokens), and the experts whose rows point along
it take every token. Scaling or zeroing the router cannot fix that: top-k of the logits does not depend on
their scale, and all-zero logits tie, so torch.topk gives every token the same k experts. So each router is
balanced on the run's own batches, layer by layer as the forward reaches it (a forward pre-hook): its
rows lose their component along the mean input (every expert's logit has mean 0 over the tokens; GPT-OSS's
router bias, a per-expert constant, is zeroed) and are rescaled to the same logit standard deviation. The
top-k choice is then decided by what is particular to each token, and the load is near even.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from megatrain.data import DataConfig, batch
from megatrain.model import family_classes
from megatrain.moe import moe_info

ROUTINGS = ("random", "uniform")
CALIBRATION_TOKENS = 65536  # tokens of the run's batches the routers are balanced on, at most


@torch.no_grad()
def balance(router: torch.nn.Module, args: tuple, iters: int = 300) -> None:
    """Forward pre-hook: balance `router` (its .weight [experts, hidden]; GPT-OSS's .bias) on its input x.
    Its rows lose their component along the mean input m and are rescaled to one logit spread; then each
    expert's row moves along m (a per-expert offset of its logits, about constant over the tokens) against its
    share of the top-k choices, a step shrinking as it goes, until the load on x is near even."""
    w, k = router.weight, router.top_k
    x = args[0].reshape(-1, w.shape[1]).to(w.dtype)
    m = x.mean(0)
    along = m / m.dot(m).clamp(min=1e-30)
    w -= torch.outer(w @ m, along)
    if getattr(router, "bias", None) is not None:
        router.bias.zero_()
    std = (x @ w.T).std(0).clamp(min=1e-30)  # each expert's logit spread over the tokens
    w *= (std.mean() / std)[:, None]
    step, even = 0.5 * float(std.mean()), x.shape[0] * k / w.shape[0]
    for i in range(iters):
        load = torch.bincount((x @ w.T).topk(k, -1).indices.reshape(-1), minlength=w.shape[0]).to(w.dtype)
        w -= torch.outer(step * (1 - i / iters) * torch.tanh(load / even - 1), m)


def uniform_model(hf, data: DataConfig, steps: int, where: Path | None = None, seed: int = 0) -> Path:
    """A fresh HF init of `hf` (fp32, seeded) with its routers balanced on the tokens the run trains on (the
    first sequences of each of its `steps` batches, CALIBRATION_TOKENS at most, one sequence a step at least),
    saved under `where` (default: a new temporary directory); the directory."""
    t0 = time.perf_counter()
    cls = family_classes(hf.model_type)[1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(hf).float()
    info = moe_info(model)
    if info is None:
        raise ValueError(f"--routing uniform: a {hf.model_type} model has no routers")
    model.config.use_cache = False
    model.eval()
    hooks = [m.register_forward_pre_hook(balance) for m in model.modules() if isinstance(m, info.router)]
    rows = max(1, min(data.batch_size, CALIBRATION_TOKENS // (data.seq_len * steps)))
    ids = torch.cat([batch(data, t)[0][:rows] for t in range(steps)])
    with torch.no_grad():
        model(input_ids=ids.to(device))
    for h in hooks:
        h.remove()
    where = Path(where or tempfile.mkdtemp(prefix="megatrain-bench-uniform-"))
    model.save_pretrained(where)
    print(
        f"[bench] --routing uniform: {len(hooks)} routers balanced on {len(ids)}x{ids.shape[1]} tokens, the model "
        f"saved to {where} in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return where
