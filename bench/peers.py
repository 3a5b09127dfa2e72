"""Peers measured in the same run as MegaTrain: the same model, batch and step count.

DeepSpeed ZeRO-3 offload is not among them yet (it needs the bundle built with --with-deepspeed).

Each returns {"name", "step_time_s", "gpu_peak_bytes"} or {"name", "status": "OOM" | "error: ..."}.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from megatrain.data import DataConfig, batch
from megatrain.model import FAMILIES


def _timed_steps(step: Callable[[int], None], steps: int) -> list[float]:
    times = []
    for t in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _trainer(model: torch.nn.Module, opt: torch.optim.Optimizer, data: DataConfig,
             autocast: bool) -> Callable[[int], None]:
    """One optimizer step on batch t: the same loss, clipping and AdamW as MegaTrain's default."""

    def step(t: int) -> None:
        ids, labels = (x.cuda() for x in batch(data, t))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _guard(name: str, fn: Callable[[], dict]) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        out = fn()
        return {"name": name, "status": "ok", "gpu_peak_bytes": torch.cuda.max_memory_allocated(), **out}
    except torch.cuda.OutOfMemoryError:
        return {"name": name, "status": "OOM"}
    except Exception as exc:  # a peer that cannot run is reported, not hidden
        return {"name": name, "status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        torch.cuda.empty_cache()


def _model(hf, device: str) -> torch.nn.Module:
    with torch.device(device):
        model = FAMILIES["qwen2"][1](hf).float()
    model.config.use_cache = False
    return model


def plain_pytorch(hf, data: DataConfig, steps: int) -> dict:
    """The whole model on the GPU: fp32 master, bf16 autocast, per-layer checkpointing, fused AdamW."""

    def run() -> dict:
        model = _model(hf, "cuda")
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        return {"step_times_s": _timed_steps(_trainer(model, opt, data, autocast=True), steps)}

    return _guard("plain PyTorch (GPU-resident)", run)


def fsdp2_offload(hf, data: DataConfig, steps: int) -> dict:
    """FSDP2 fully_shard with CPUOffloadPolicy at world size 1 (parameters and optimizer on the CPU)."""

    def run() -> dict:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=0, world_size=1)
        try:
            model = _model(hf, "cpu")
            model.gradient_checkpointing_enable()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
            fully_shard(model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            # FSDP2's MixedPrecisionPolicy does the bf16 casting, so no autocast here
            return {"step_times_s": _timed_steps(_trainer(model, opt, data, autocast=False), steps)}
        finally:
            dist.destroy_process_group()

    return _guard("FSDP2 CPU offload", run)


PEERS = {"plain": plain_pytorch, "fsdp2": fsdp2_offload}
