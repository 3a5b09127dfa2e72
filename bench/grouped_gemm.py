"""The GPU's grouped-GEMM rate at a mixture of experts' sizes: the ceiling of its expert compute.

  python bench/grouped_gemm.py --model olmoe-1b-7b --tokens 65536 [--iters 20]

One layer's routed experts as HF runs them on CUDA (transformers' grouped_mm experts: one grouped GEMM per
projection over the token-expert rows sorted by expert), in bf16, with the rows spread evenly over the
experts (tokens × top-k rows): the fused gate/up projection [E, 2I, H] and the down projection [E, H, I],
forward and backward (input and weight gradients: 3 GEMMs' work per projection). Prints TFLOPS counted as
2 · rows · (2I·H + H·I) per forward, three times that per forward + backward, and a plain GEMM of the
same rows and sizes (torch.mm, one expert's weights for all rows) for comparison; and one whole decoder
layer of the preset as HF builds it (router, experts, attention; random weights, so routed as a random
init routes), forward and forward + backward, in TFLOPS by 6·N_active·D + 12·H·S·D per layer: what the
layer itself can do. bench/run.py's TFLOPS of a mixture of experts is read against these.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.run import MODELS  # noqa: E402


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [rows, in] by w [E, out, in] per expert's rows (offs: cumulative row ends): [rows, out]."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w.transpose(-2, -1), offs=offs)


def timed(fn, iters: int) -> float:
    """Seconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def measure(hidden: int, inter: int, experts: int, top_k: int, tokens: int, iters: int) -> dict:
    rows = tokens * top_k
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, hidden, device=dev, dtype=dt, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt, requires_grad=True)
    down = torch.randn(experts, hidden, inter, device=dev, dtype=dt, requires_grad=True)
    # an even split: every expert gets rows // experts rows (the remainder to the last)
    ends = [(i + 1) * (rows // experts) for i in range(experts)]
    ends[-1] = rows
    offs = torch.tensor(ends, device=dev, dtype=torch.int32)

    def forward() -> torch.Tensor:
        h = grouped_mm(x, gate_up, offs)
        g, u = h.chunk(2, dim=-1)
        return grouped_mm(torch.nn.functional.silu(g) * u, down, offs)

    grad = torch.randn(rows, hidden, device=dev, dtype=dt)  # dense: grouped_mm's backward takes no expanded grad

    def forward_backward() -> None:
        forward().backward(grad)
        x.grad = gate_up.grad = down.grad = None

    a = torch.randn(rows, hidden, device=dev, dtype=dt)
    b = torch.randn(hidden, 2 * inter, device=dev, dtype=dt)
    c = torch.randn(rows, inter, device=dev, dtype=dt)
    d = torch.randn(inter, hidden, device=dev, dtype=dt)
    flops = 2 * rows * (2 * inter * hidden + hidden * inter)
    with torch.no_grad():
        fwd = timed(forward, iters)
        plain = timed(lambda: (a @ b, c @ d), iters)
    both = timed(forward_backward, iters)
    return {
        "rows": rows,
        "rows_per_expert": rows // experts,
        "forward_tflops": flops / fwd / 1e12,
        "forward_backward_tflops": 3 * flops / both / 1e12,
        "plain_gemm_tflops": flops / plain / 1e12,
        "forward_s": fwd,
        "forward_backward_s": both,
    }


def hf_layer(model: str, batch: int, seq: int, iters: int) -> dict:
    """One HF decoder layer of the preset in bf16 on the GPU: seconds forward (no grad) and forward + backward."""
    import transformers

    from bench.run import bench_model
    from megatrain.model.spec import ATTENTION, family_classes

    family = MODELS[model][0]
    hf_dict, _ = bench_model(model, 1, [])
    config = family_classes(family)[0](**{**hf_dict, "output_router_logits": False})
    config._attn_implementation = ATTENTION  # the product's (SDPA; GPT-OSS's sinks too): HF's eager is O(S²)
    with torch.device("cuda"):
        lm = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    layer = lm.model.layers[0]
    x = torch.randn(batch, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    emb = lm.model.rotary_emb(x, pos)
    grad = torch.randn_like(x)

    def forward() -> torch.Tensor:
        out = layer(x, position_embeddings=emb, attention_mask=None, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def forward_backward() -> None:
        forward().backward(grad)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    with torch.no_grad():
        fwd = timed(forward, iters)
    both = timed(forward_backward, iters)
    share = config.num_experts_per_tok / (getattr(config, "num_experts", None) or config.num_local_experts)
    active = sum(p.numel() * (share if ".experts." in n else 1.0) for n, p in layer.named_parameters())
    tokens = batch * seq
    flops = 6 * active * tokens + 12 * config.hidden_size * seq * tokens  # forward + backward, as 6ND counts
    return {
        "layer_forward_s": fwd,
        "layer_forward_backward_s": both,
        "layer_tflops": flops / both / 1e12,
        "layer_tflops_with_recompute": flops / (both + fwd) / 1e12,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[m for m, (family, *_) in MODELS.items() if family != "qwen2"], required=True)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per layer call (a multiple of 4096: batch × 4096)")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/grouped_gemm.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    hf = MODELS[args.model][1]
    experts = hf.get("num_experts") or hf["num_local_experts"]
    res = measure(
        hf["hidden_size"], hf["intermediate_size"], experts, hf["num_experts_per_tok"], args.tokens, args.iters
    )
    res.update(hf_layer(args.model, args.tokens // 4096, 4096, max(args.iters // 4, 3)))
    res.update(model=args.model, tokens=args.tokens, gpu=torch.cuda.get_device_name())
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
