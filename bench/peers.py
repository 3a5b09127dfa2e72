"""Peers measured in the same run as MegaTrain: the same model, batch and step count.

DeepSpeed ZeRO-3 offload runs when deepspeed is importable (../shared/device/make-bundle.sh
--with-deepspeed bundles it); otherwise it is reported as "not installed", never skipped silently.

Each returns {"name", "step_time_s", "gpu_peak_bytes"} or {"name", "status": "OOM" | "error: ..."}.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from megatrain.data import DataConfig, batch
from megatrain.model import family_classes


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
        model = family_classes("qwen2")[1](hf).float()
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


def _ds_config(data: DataConfig, torch_adam: bool) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory; bf16 compute, fp32 master
    and Adam state on the CPU; the same clipping and learning rate as the other peers."""
    cfg = {"train_micro_batch_size_per_gpu": data.batch_size, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    if torch_adam:
        cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    return cfg


def deepspeed_zero3(hf, data: DataConfig, steps: int) -> dict:
    """DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU, at world size 1.

    Its own CPU Adam is a C++ extension built on first use; where that build fails (no compiler on
    the machine) the peer runs with torch's AdamW on the offloaded fp32 partitions and says so."""
    try:
        import deepspeed
    except ImportError:
        return {"name": "DeepSpeed ZeRO-3 offload", "status": "not installed"}

    def run(torch_adam: bool) -> dict:
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                     ("MASTER_PORT", "29518")):
            os.environ.setdefault(k, v)
        deepspeed.init_distributed(dist_backend="nccl", verbose=False)
        model = _model(hf, "cpu")
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0) if torch_adam else None
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(data, torch_adam),
                                          model_parameters=None if torch_adam else model.parameters())

        def step(t: int) -> None:
            ids, labels = (x.cuda() for x in batch(data, t))
            engine.backward(engine(input_ids=ids, labels=labels).loss)
            engine.step()

        try:
            return {"step_times_s": _timed_steps(step, steps)}
        finally:
            engine.destroy()

    res = _guard("DeepSpeed ZeRO-3 offload", lambda: run(False))
    if res["status"].startswith("error"):
        first = res["status"]
        res = _guard("DeepSpeed ZeRO-3 offload (torch AdamW)", lambda: run(True))
        res["note"] = f"DeepSpeedCPUAdam failed: {first}"
    return res


PEERS = {"plain": plain_pytorch, "fsdp2": fsdp2_offload, "deepspeed": deepspeed_zero3}
