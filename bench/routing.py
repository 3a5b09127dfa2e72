"""--routing uniform: the bench's model with every MoE router balanced at init, as a save_pretrained directory
that MegaTrain (model.pretrained) and every peer (from_pretrained) start from, so they train the same model.

HF's random init routes unevenly, more so with depth: a router's input has a component common to every token,
and the experts whose rows point along it take most tokens. Scaling or zeroing the router cannot fix that: top-k
of the logits does not depend on their scale, and all-zero logits tie, so torch.topk gives every token the same
k experts. So each router is balanced on the run's own tokens (bench/tokens.py), layer by layer as the forward
reaches it (a forward pre-hook), on what the layers balanced before it give (balance()). A GPU run computes the
router's logits in bf16 (8 bits of mantissa): per-expert offsets large against the logits' token-to-token
spread would round that spread away and give every token the same k experts, so the offsets that even the load
stay within a few spreads, and the load is checked with bf16 logits as well as fp32 ones.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.tokens import batches
from megatrain.data import DataConfig
from megatrain.layers.moe import moe_info
from megatrain.model.spec import family_classes

ROUTINGS = ("random", "uniform")
CALIBRATION_TOKENS = 65536  # tokens of the run's batches the routers are balanced on, at most
TARGET = 1.1  # the busiest expert's top-k choices over an even share that a balanced router stops at
ITERS = 100  # scale steps at most (each two small matmuls on the calibration tokens)


def _load(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each expert's count of top-k choices over the rows of `logits` [tokens, experts]."""
    return torch.bincount(logits.topk(k, -1).indices.reshape(-1), minlength=logits.shape[1]).float()


@torch.no_grad()
def balance(router: torch.nn.Module, args: tuple, iters: int = ITERS, target: float = TARGET) -> None:
    """Forward pre-hook: balance `router` (its .weight [experts, hidden]; GPT-OSS's .bias) on its input x, in
    bf16 and fp32 alike, with no per-expert constant in its logits.

    Its rows are whitened by the covariance C of x along the directions x varies more than on average (C's
    eigenvalues below their mean are raised to it, so that directions the calibration tokens barely span are
    not blown up): a direction the inputs vary much along, such as a component the tokens of a sequence
    share, no longer decides every token's choice. They lose their component along the mean input m (each
    expert's logit has mean 0 over the tokens; GPT-OSS's bias is zeroed) and are rescaled to the init's logit
    spread. Then each row's scale moves against its expert's share of the top-k choices (a larger spread wins
    more of them), measured with fp32 logits and with bf16 ones (F.linear in bf16, as a GPU run computes
    them), until the busiest expert takes at most `target` times an even share in both; the most even weights
    seen are kept. A covariance and one scale per expert are properties of the token distribution more than
    of the calibration tokens, where per-expert offsets could be fitted to the calibration tokens alone."""
    w, k = router.weight, router.top_k
    x = args[0].reshape(-1, w.shape[1]).float()
    m = x.mean(0)
    r = x - m
    v = w.detach().float()
    if getattr(router, "bias", None) is not None:
        router.bias.zero_()
    spread = float((r @ v.T).std(0).mean())  # the init's
    e, u = torch.linalg.eigh(r.T @ r / x.shape[0])
    e = e.clamp(min=float(e.mean()))
    v = v @ (u * e.rsqrt()) @ u.T
    v -= torch.outer(v @ m, m / m.dot(m).clamp(min=1e-30))
    v *= (spread / (r @ v.T).std(0).clamp(min=1e-30))[:, None]
    xb, even = x.bfloat16(), x.shape[0] * k / w.shape[0]
    best, worst = v.clone(), float("inf")
    for i in range(iters):
        l32, l16 = _load(x @ v.T, k), _load(F.linear(xb, v.bfloat16()), k)
        busiest = float(torch.maximum(l32, l16).max()) / even
        if busiest < worst:
            best, worst = v.clone(), busiest
        if busiest <= target:
            break
        # damped and shrinking: the loads of the experts move together
        step = (2 * even / (l32 + l16).clamp(min=1)) ** (0.3 * (1 - i / iters))
        v *= step.clamp(0.8, 1.25)[:, None]
    w.copy_(best.to(w.dtype))


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
    get = batches(data, hf)
    ids = torch.cat([get(t)[0][:rows] for t in range(steps)])
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
