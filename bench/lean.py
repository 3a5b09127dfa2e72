"""One decoder layer of the Qwen2.5-7B shape on the GPU, plain and lean (megatrain/step/lean.py): the bytes it
keeps from its forward to its backward, the backward's peak above that, and the time of forward + backward,
against the memory model's numbers (megatrain/memory/autosize.py).

  python bench/lean.py --batch 16 --seq 4096 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import QWEN7B  # noqa: E402
from megatrain.memory import autosize  # noqa: E402
from megatrain.model.spec import ModelConfig, build_spec, family_classes  # noqa: E402
from megatrain.step.lean import lean_call  # noqa: E402


def measure(layer, pe, pos_ids, x: torch.Tensor, lean: bool, reps: int) -> dict:
    def run(inp):
        out = layer(inp, position_embeddings=pe, position_ids=pos_ids, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    times, kept, peak = [], 0, 0
    for _ in range(reps + 1):  # the first is the warm-up
        inp = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = lean_call(run, inp) if lean else run(inp)
        mid.record()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        torch.cuda.reset_peak_memory_stats()
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times.append((start.elapsed_time(mid) / 1e3, mid.elapsed_time(end) / 1e3))
        del out, inp
        layer.zero_grad(set_to_none=True)
    fwd = statistics.median(t[0] for t in times[1:])
    bwd = statistics.median(t[1] for t in times[1:])
    return {"kept_GiB": kept / 2**30, "backward_peak_GiB": peak / 2**30, "forward_s": fwd, "backward_s": bwd}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    hf_fields = {**QWEN7B, "num_hidden_layers": 1}
    spec = build_spec(ModelConfig(family="qwen2", hf=hf_fields))
    conf = spec.hf_config
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = family_classes("qwen2")[1](conf).to(torch.bfloat16)
    layer = model.model.layers[0]
    x = torch.randn(args.batch, args.seq, conf.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos_ids = torch.arange(args.seq, device="cuda").unsqueeze(0)
    with torch.no_grad():
        pe = model.model.rotary_emb(x, pos_ids)
    tokens = args.batch * args.seq
    numel = sum(p.numel() for p in layer.parameters())
    res = {
        "tokens": tokens,
        "model_full_GiB": autosize.layer_activation_bytes(spec, tokens, 2) / 2**30,
        # the model's lean bytes count the weights the last block keeps; a module's weights are not kept here
        "model_lean_GiB": (autosize.lean_bytes(spec, tokens, 2) - 2 * numel) / 2**30,
    }
    for name, lean in (("plain", False), ("lean", True)):
        res[name] = measure(layer, pe, pos_ids, x, lean, args.reps)
        print(json.dumps({name: res[name]}), flush=True)
    res["lean_overhead_s"] = (
        res["lean"]["forward_s"] + res["lean"]["backward_s"] - res["plain"]["forward_s"] - res["plain"]["backward_s"]
    )
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
