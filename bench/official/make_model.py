"""Write a random-initialised Hugging Face Qwen2 model directory (bf16 safetensors), one shard per layer.

Glue for the official-MegaTrain benchmark; no official code involved. Default shape is Qwen2.5-7B's layer
(hidden 3584, ffn 18944, 28 heads, 4 KV heads, vocab 152064, rope_theta 1e6, untied, q/k/v biases).
Tensor names and shapes come from the model built on the meta device (no memory), and each shard is
generated and written on its own, so peak RAM is about one shard (the embedding: vocab*hidden*2 bytes).
Init as Hugging Face's Qwen2 _init_weights: weights N(0, initializer_range), biases 0, norm weights 1.

Usage: python3 make_model.py OUTDIR [--layers 8] [--hidden 3584 --intermediate 18944 --heads 28
                                     --kv-heads 4 --vocab 152064] [--seed 0]
A directory already completed by this script with the same arguments (make_model.json) is kept as it is.
"""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config


def build_config(a):
    kw = dict(
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        num_hidden_layers=a.layers,
        vocab_size=a.vocab,
        max_position_embeddings=131072,
        max_window_layers=a.layers,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_cache=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=151643 if a.vocab > 151643 else None,
        eos_token_id=151643 if a.vocab > 151643 else None,
    )
    try:  # transformers 5.x
        cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta}, **kw)
    except TypeError:  # transformers 4.x
        cfg = Qwen2Config(rope_theta=a.rope_theta, **kw)
    cfg.architectures = ["Qwen2ForCausalLM"]
    try:
        cfg.dtype = "bfloat16"
    except Exception:
        cfg.torch_dtype = "bfloat16"
    return cfg


def shard_of(name):
    # model.layers.<i>.*  -> one shard per layer; embedding alone; final norm + lm_head together
    parts = name.split(".")
    if "layers" in parts:
        return f"layer-{int(parts[parts.index('layers') + 1]):05d}"
    if "embed_tokens" in name:
        return "embed"
    return "head"


ROWS_ELEMS = 1 << 24  # a draw job: this many values (the embedding alone is 545M: one thread took ~10 s)


def make_tensor(name, shape, seed, std, pool):
    """The tensor, its normal draws split into row blocks of about ROWS_ELEMS values, each block from its
    own generator (seed, block) and drawn by the pool: the values do not depend on the thread count."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.bfloat16)
    rows = t.view(shape[0], -1)
    step = max(1, ROWS_ELEMS // max(rows.shape[1], 1))

    def draw(block):
        gen = torch.Generator().manual_seed(seed * 65_537 + block)
        rows[block * step : (block + 1) * step].normal_(0.0, std, generator=gen)

    list(pool.map(draw, range(-(-shape[0] // step))))
    return t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=18944)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    cfg = build_config(a)
    os.makedirs(a.outdir, exist_ok=True)
    stamp_path = os.path.join(a.outdir, "make_model.json")
    stamp = dict(vars(a), outdir=None, format=3)
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                print(f"[make_model] {a.outdir} already complete for these arguments, kept")
                return
        os.remove(stamp_path)

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    specs = [(n, tuple(t.shape)) for n, t in meta.state_dict().items()]
    n_params = sum(t.numel() for t in meta.parameters())
    del meta

    groups = {}
    for n, shape in specs:
        groups.setdefault(shard_of(n), []).append((n, shape))
    order = ["embed"] + sorted(k for k in groups if k.startswith("layer-")) + ["head"]
    order = [k for k in order if k in groups]
    nfile = len(order)

    weight_map, total = {}, 0
    t0 = time.time()
    index = {n: k for k, (n, _) in enumerate(specs)}
    # Generators per row block of each tensor (seed, tensor index, block), drawn by a thread pool: a draw
    # releases the GIL, and one generator drawing 3B bf16 values alone took 85 s (one per tensor: 44 s)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for i, key in enumerate(order):
            fname = f"model-{i + 1:05d}-of-{nfile:05d}.safetensors"
            tensors = {
                n: make_tensor(n, shape, a.seed * 1_000_003 + index[n], cfg.initializer_range, pool)
                for n, shape in groups[key]
            }
            for n, t in tensors.items():
                weight_map[n] = fname
                total += t.numel() * t.element_size()
            save_file(tensors, os.path.join(a.outdir, fname), metadata={"format": "pt"})
        del tensors
        print(f"[make_model] {fname} ({key}) {time.time() - t0:.1f}s", flush=True)

    with open(os.path.join(a.outdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg.save_pretrained(a.outdir)
    with open(stamp_path, "w") as f:  # written last: marks the directory complete
        json.dump(stamp, f)
    print(
        f"[make_model] wrote {a.outdir}: {a.layers} layers, {n_params:,} params, "
        f"{total / 2**30:.2f} GiB in {nfile} shards, {time.time() - t0:.1f}s"
    )


if __name__ == "__main__":
    sys.exit(main())
