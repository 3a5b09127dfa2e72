"""The executor's compute settings (the config tree's `engine` section) and the sizes an `auto` takes where no
memory is scarce. Free of torch, so the config tree, its checks and the memory plan load without it;
megatrain/step/engine.py, which computes with them, imports them from here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatrain.config.base import opt


@dataclass
class EngineConfig:
    device: str = opt("auto", "Where the layers compute: auto (cuda if present), cuda or cpu.")
    compute_dtype: str = opt(
        "auto",
        "Compute and weight-streaming dtype: auto (bf16 on cuda, fp32 on cpu), "
        "bf16 or fp32. Master weights and Adam state are fp32 regardless.",
    )
    checkpoint_interval: int | str = opt(
        "auto",
        "K: keep the activation at the input of every K-th layer; a block "
        "of K layers is recomputed once, with grad, right before its "
        "backward. auto: megatrain/memory/autosize.py (2; 1 when the GPU holds "
        "fewer than 2 layers' activations).",
    )
    last_block_layers: int | str = opt(
        "auto",
        "Layers in the last block, the one never recomputed: it runs with grad "
        "in the forward and keeps its activations on the GPU until its "
        "backward. 0 = K. Each extra layer saves one layer's recompute and "
        "costs one layer's activations of GPU memory (about 17 GiB for a 7B "
        "layer at 64k tokens). auto: as many as the free GPU memory holds.",
    )
    lean_layers: int | str = opt(
        "auto",
        "Layers of the last block (its first ones) that keep only the outputs of "
        "their matmuls and attention for the backward and recompute the rest there "
        "(norms, activation function, RoPE: elementwise work, about 9 % of a layer's "
        "time) in about half the activation memory (megatrain/step/lean.py), so the last "
        "block holds more layers. 0 = none; more than the last block has = all of "
        "it. auto: the fewest that let the last block hold the layers the rule picks.",
    )
    prefetch: int = opt(
        2,
        "CUDA: units whose weights may be loaded ahead of compute (1 = double buffering, "
        "2 = triple); 0 copies on the compute stream (the no-double-buffering ablation).",
    )
    loss_chunk_tokens: int | str = opt(
        "auto",
        "Tokens per LM-head/loss chunk; [chunk, vocab] logits is the "
        "largest head activation. auto: 8192 where an eighth of the free GPU "
        "memory holds the chunk's logits, else less (2048 on the CPU).",
    )
    chunk_sequences: int | str = opt(
        "auto",
        "Sequences per compute chunk: every layer runs the batch in chunks of "
        "this many sequences and sums its gradient over the chunks on the device "
        "in fp32 before it leaves, so activation memory follows the chunk and "
        "PCIe traffic stays one gradient per layer per step; 0 = the whole batch "
        "in one chunk. auto: the whole batch when K layers' activations fit, "
        "else the largest chunk that does; with clipping, the fewest chunks "
        "that put every layer in the last block where that saves a quarter "
        "or more of the recompute (megatrain/memory/autosize.py).",
    )
    token_tile: int | str = opt(
        "auto",
        "Tokens per tile of a layer's position-wise half (post-attention norm, MLP, "
        "residual): it runs tile by tile in the forward and again in the backward, "
        "so its memory follows the tile, not the sequence (megatrain/step/tiling.py; "
        "for long context). 0 = untiled. auto: untiled where a layer's "
        "activations fit, else the largest tile that does (megatrain/memory/autosize.py).",
    )
    offload_checkpoints: bool | int | str = opt(
        "auto",
        "CUDA: keep the activation checkpoints (one per recompute block, "
        "tokens·hidden·2 bytes each) in pinned host memory (out in the "
        "forward, back one block ahead in the backward) instead of GPU "
        "memory; N: the first N blocks' in pinned host memory, the rest on "
        "the GPU. auto: on the GPU where they take at most an eighth of "
        "the room left for activations, else in host memory, as many as "
        "the host holds beside the store and the rest on the GPU.",
    )
    moe_experts: str = opt(
        "megatrain",
        "How a mixture-of-experts layer runs its experts: megatrain (megatrain/layers/experts.py: the routed rows "
        "sorted once per layer, one grouped GEMM per projection, a backward of its own that keeps the "
        "gate/up output and recomputes the activation from it) or hf (transformers' own grouped-GEMM path, "
        "differentiated by autograd). Dense models ignore it.",
    )
    gpu_optimizer: int | str = opt(
        "auto",
        "Units, from the forward's first (the input embedding, the layers, then the final norm and LM head), "
        "whose fp32 master weights, Adam moments and gradient live on the GPU, where the executor updates them "
        "right after the global norm is known, bit for bit as the host's Adam would: the next forward starts "
        "on them at once while the host updates the rest ahead of it. Their gradients come last in the "
        "backward, so no overlap hides their host update. With several GPUs sharing one store the units are "
        "shared among them: each updates its share and sends the others the new weights; over several hosts "
        "each host holds and updates its slice of their state, as its store holds its slice of the rest. "
        "0 = none. auto: as many as the GPU memory the plan leaves beside the step's peak holds (none on the "
        "CPU device or with ipc.staging slabs); megatrain-launch plan shows the choice.",
    )
    gpu_memory_gib: float | str | None = opt(
        None,
        "CUDA: the most GPU memory, in GiB, the run may take on each of its GPUs, the CUDA context "
        "included (what nvidia-smi shows for the process; megatrain/memory/budget.py). The automatic sizes "
        "and the plan fit it (or the free memory, where less is free), and the executor caps PyTorch's "
        "caching allocator at it less the context. null or auto: all of the GPU's free memory.",
    )

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"engine.device must be auto, cpu or cuda, not '{self.device}'")
        if self.compute_dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"engine.compute_dtype must be auto, bf16 or fp32, not '{self.compute_dtype}'")
        for key, least, what in (
            ("checkpoint_interval", 1, ">= 1"),
            ("last_block_layers", 0, ">= 0 (0 = K)"),
            ("loss_chunk_tokens", 1, ">= 1"),
            ("lean_layers", 0, ">= 0 (0 = none)"),
            ("chunk_sequences", 0, ">= 0 (0 = the whole batch in one chunk)"),
            ("token_tile", 0, ">= 0 (0 = untiled)"),
            ("gpu_optimizer", 0, ">= 0 (0 = none)"),
        ):
            value = getattr(self, key)
            if value != "auto" and (isinstance(value, str) or value < least):
                raise ValueError(f"engine.{key} must be 'auto' or an integer {what}, not {value!r}")
        off = self.offload_checkpoints
        if off != "auto" and not isinstance(off, bool) and not (isinstance(off, int) and off >= 0):
            raise ValueError(
                f"engine.offload_checkpoints must be auto, true, false or a count >= 0 of checkpoints in host "
                f"memory, not {off!r}"
            )
        if self.moe_experts not in ("hf", "megatrain"):
            raise ValueError(f"engine.moe_experts must be hf or megatrain, not {self.moe_experts!r}")
        if self.prefetch < 0:
            raise ValueError("engine.prefetch must be >= 0")
        budget = self.gpu_memory_gib
        if budget is not None and budget != "auto" and (isinstance(budget, str) or not 0 < budget < math.inf):
            raise ValueError(f"engine.gpu_memory_gib must be null, auto or a finite number of GiB > 0, not {budget!r}")


# What an `auto` size is where no memory is scarce (the CPU device; megatrain/memory/autosize.py decides on CUDA).
FIXED_SIZES = {
    "checkpoint_interval": 2,
    "last_block_layers": 0,
    "chunk_sequences": 0,
    "loss_chunk_tokens": 2048,
    "lean_layers": 0,
    "offload_checkpoints": True,
    "token_tile": 0,
}


def fixed_sizes(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with every size still 'auto' set to FIXED_SIZES."""
    return dataclasses.replace(cfg, **{k: v for k, v in FIXED_SIZES.items() if getattr(cfg, k) == "auto"})


def resolve_engine(cfg: EngineConfig, cuda: bool) -> EngineConfig:
    """`auto` settings made concrete, once the driver knows whether the executor's node has a GPU."""
    dtype = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bf16" if cuda else "fp32")
    return dataclasses.replace(cfg, device="cuda" if cuda else "cpu", compute_dtype=dtype)
