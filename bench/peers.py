"""Peers measured in the same run as MegaTrain: the same model, batch and step count.

DeepSpeed ZeRO-3 offload runs when deepspeed is importable (../shared/device/make-bundle.sh
--with-deepspeed bundles it); otherwise it is reported as "not installed", never skipped silently.
The official MegaTrain code runs as a subprocess through our glue in bench/official, from a checkout outside this
repository (bench/official/checkout.py: --official-src, $MEGATRAIN_OFFICIAL_SRC or ../shared/peers/official/src),
and needs DeepSpeed too.

Each returns {"name", "step_time_s", "gpu_peak_bytes"} or {"name", "status": "OOM" | "error: ..."}.
With `gpu_gib` (bench/run.py --gpu-gib) each peer's process caps its caching allocator as MegaTrain's executor
does for engine.gpu_memory_gib (megatrain/memory/budget.py: the budget less the process's CUDA context), before
the peer allocates anything; what the cap refuses is the row's OOM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.official.checkout import commit_of, official_src
from bench.tokens import batches
from megatrain.data import DataConfig
from megatrain.memory import budget as gpubudget
from megatrain.model.spec import family_classes


def _timed_steps(step: Callable[[int], None], steps: int) -> list[float]:
    times = []
    for t in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _trainer(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: DataConfig, autocast: bool
) -> Callable[[int], None]:
    """One optimizer step on batch t (MegaTrain's batch t: bench/tokens.py): the same loss, clipping and AdamW as
    MegaTrain's default."""
    get = batches(data, model.config)

    def step(t: int) -> None:
        ids, labels = (x.cuda() for x in get(t))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _guard(name: str, fn: Callable[[], dict], gpu_gib: float | None = None) -> dict:
    """Run a peer on the current GPU, capped at `gpu_gib` GiB (the CUDA context included) where given."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    device = torch.cuda.current_device()
    try:
        cap = gpubudget.cap_device(device, None if gpu_gib is None else int(gpu_gib * gpubudget.GIB))
        out = fn()
        budget = {"gpu_budget": str(cap)} if cap else {}
        return {"name": name, "status": "ok", "gpu_peak_bytes": torch.cuda.max_memory_allocated(), **budget, **out}
    except torch.cuda.OutOfMemoryError:
        return {"name": name, "status": "OOM"}
    except Exception as exc:  # a peer that cannot run is reported, not hidden
        return {"name": name, "status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        torch.cuda.empty_cache()
        gpubudget.cap_device(device, None)  # the next row, in this process, has the whole GPU again


def _model(hf, device: str, init: str | Path | None = None) -> torch.nn.Module:
    """The model in fp32 on `device`: read from `init` (bench/run.py --routing uniform: the saved init MegaTrain
    starts from too), else drawn fresh. A CPU model is drawn on the GPU when it fits there and then moved:
    torch's CPU normal draws run on one thread (about 30 s for 3B parameters), which is set-up, not step."""
    t0 = time.perf_counter()
    cls = family_classes(hf.model_type)[1]
    model = None
    if init is not None:
        # the attention the fresh draw runs (a saved config does not keep it): HF's default would be another
        model = cls.from_pretrained(str(init), dtype=torch.float32, attn_implementation=hf._attn_implementation).to(
            device
        )
    elif device == "cpu" and torch.cuda.is_available():
        try:
            with torch.device("cuda"):
                model = cls(hf).float()
            model = model.cpu()
        except torch.cuda.OutOfMemoryError:
            model = None
        torch.cuda.empty_cache()
    if model is None:
        with torch.device(device):
            model = cls(hf).float()
    model.config.use_cache = False
    print(
        f"[peers] model of {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {device} in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return model


def plain_pytorch(hf, data: DataConfig, steps: int, gpu_gib: float | None = None, init: Path | None = None) -> dict:
    """The whole model on the GPU: fp32 master, bf16 autocast, per-layer checkpointing, fused AdamW."""

    def run() -> dict:
        model = _model(hf, "cuda", init)
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        return {"step_times_s": _timed_steps(_trainer(model, opt, data, autocast=True), steps)}

    return _guard("plain PyTorch (GPU-resident)", run, gpu_gib)


def fsdp2_offload(hf, data: DataConfig, steps: int, gpu_gib: float | None = None, init: Path | None = None) -> dict:
    """FSDP2 fully_shard with CPUOffloadPolicy at world size 1 (parameters and optimizer on the CPU)."""

    def run() -> dict:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=0, world_size=1)
        try:
            model = _model(hf, "cpu", init)
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

    return _guard("FSDP2 CPU offload", run, gpu_gib)


def _ds_config(data: DataConfig, torch_adam: bool) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory; bf16 compute, fp32 master
    and Adam state on the CPU; the same clipping and learning rate as the other peers."""
    cfg = {
        "train_micro_batch_size_per_gpu": data.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    if torch_adam:
        cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    return cfg


def deepspeed_zero3(
    hf, data: DataConfig, steps: int, gpus: int = 1, gpu_gib: float | None = None, init: Path | None = None
) -> dict:
    """DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU, at world size `gpus` (one spawned
    process per GPU, each `data.batch_size` sequences a step, as DeepSpeed's launcher would run them; with
    one GPU too, so that a process the kernel kills for host memory is the row's result, not the bench's end).

    Its own CPU Adam is a C++ extension built on first use; where that build fails (no compiler on
    the machine) the peer runs with torch's AdamW on the offloaded fp32 partitions and says so."""
    if importlib.util.find_spec("deepspeed") is None:
        return {"name": "DeepSpeed ZeRO-3 offload", "status": "not installed"}
    return _deepspeed_ranks(hf, data, steps, gpus, gpu_gib, init)


def _deepspeed_rank(
    hf, data: DataConfig, steps: int, rank: int, world: int, gpu_gib: float | None = None, init: Path | None = None
) -> dict:
    import deepspeed

    def run(torch_adam: bool) -> dict:
        for k, v in (
            ("RANK", str(rank)),
            ("LOCAL_RANK", str(rank)),
            ("WORLD_SIZE", str(world)),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29518"),
        ):
            os.environ[k] = v if world > 1 else os.environ.get(k, v)
        deepspeed.init_distributed(dist_backend="nccl", verbose=False)
        cfg = _ds_config(data, torch_adam)
        model = _partitioned_model(hf, cfg) if init is None and _too_big_whole(hf, world) else _model(hf, "cpu", init)
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0) if torch_adam else None
        t0 = time.perf_counter()
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            config=cfg,
            model_parameters=None if torch_adam else model.parameters(),
        )
        print(f"[peers] deepspeed.initialize {time.perf_counter() - t0:.1f} s", flush=True)

        get = batches(data, hf)

        def step(t: int) -> None:
            ids, labels = (x.cuda() for x in get(t * world + rank))  # each rank its own batch
            engine.backward(engine(input_ids=ids, labels=labels).loss)
            engine.step()

        try:
            return {"step_times_s": _timed_steps(step, steps)}
        finally:
            engine.destroy()

    torch.cuda.set_device(rank)  # before the cap: it is the current device's
    res = _guard("DeepSpeed ZeRO-3 offload", lambda: run(False), gpu_gib)
    if res["status"].startswith("error"):
        first = res["status"]
        res = _guard("DeepSpeed ZeRO-3 offload (torch AdamW)", lambda: run(True), gpu_gib)
        res["note"] = f"DeepSpeedCPUAdam failed: {first}"
    return res


def _too_big_whole(hf, world: int) -> bool:
    """Whether `world` ranks' whole fp32 models would take more than a quarter of the host's available memory:
    then each rank builds the model partitioned (_partitioned_model), as DeepSpeed's guide says to for large
    models. Smaller models are built whole, as the rows measured at those sizes were."""
    with torch.device("meta"):
        numel = sum(p.numel() for p in family_classes(hf.model_type)[1](hf).parameters())
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return world * 4 * numel > available / 4


def _partitioned_model(hf, cfg: dict) -> torch.nn.Module:
    """The model built under deepspeed.zero.Init the way transformers does it for ZeRO-3 (HfDeepSpeedConfig:
    each layer partitioned to pinned CPU memory as it is made, then initialized gathered): no rank ever holds
    the whole model."""
    from transformers.integrations import HfDeepSpeedConfig

    t0 = time.perf_counter()
    keep = HfDeepSpeedConfig(cfg)  # transformers asks this (weakly held) object whether ZeRO-3 is on
    model = family_classes(hf.model_type)[1]._from_config(hf, dtype=torch.float32)
    model.config.use_cache = False
    model._megatrain_ds_config = keep  # alive as long as the model
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(f"[peers] model of {numel / 1e9:.2f}B parameters built partitioned in {time.perf_counter() - t0:.1f} s")
    return model


def _deepspeed_child(
    rank: int, hf, data: DataConfig, steps: int, world: int, gpu_gib: float | None, init: Path | None, out: str
) -> None:
    res = _deepspeed_rank(hf, data, steps, rank, world, gpu_gib, init)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def _deepspeed_ranks(
    hf, data: DataConfig, steps: int, world: int, gpu_gib: float | None = None, init: Path | None = None
) -> dict:
    """One process per GPU (spawned: CUDA and NCCL start fresh in each); rank 0's step times and the
    largest GPU peak. A rank the kernel ends, or one that fails, makes the row's status."""
    name = "DeepSpeed ZeRO-3 offload"
    torch.cuda.empty_cache()  # our cached blocks back to the driver: the ranks need the whole GPUs
    ranks = spawn_ranks(name, _deepspeed_child, (hf, data, steps, world, gpu_gib, init), world)
    if isinstance(ranks, dict):
        return ranks
    res = dict(ranks[0])
    if res.get("status") == "ok":
        res["gpu_peak_bytes"] = max(r.get("gpu_peak_bytes", 0) for r in ranks)
    bad = [r for r in ranks if r.get("status") != "ok"]
    if bad:
        res["status"] = bad[0]["status"]
    return {**res, "gpus": world, "batch": data.batch_size * world}


def spawn_ranks(name: str, child: Callable, args: tuple, world: int) -> list[dict] | dict:
    """`child(rank, *args, out)` in `world` spawned processes, each writing out/rank{rank}.json: their results,
    or the row's failure where one was killed or failed (the signal named: SIGKILL is the OOM killer's)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(child, (*args, out), nprocs=world, start_method="spawn")
        except mp.ProcessExitedException as exc:  # a rank ended by a signal or an exit without a result
            why = f"killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
            if exc.signal_name == "SIGKILL":
                why += " (how the kernel's OOM killer ends a process when the host runs out of memory)"
            return {"name": name, "status": f"error: rank {exc.error_index} {why}", "gpus": world}
        except Exception as exc:  # a rank failed
            return {"name": name, "status": f"error: {type(exc).__name__}: {str(exc)[-300:]}", "gpus": world}
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


OFFICIAL_DIR = Path(__file__).resolve().parent / "official"


def _official_model_args(hf) -> list[str]:
    """make_model.py flags for exactly hf's shape: its defaults are Qwen2.5-7B's, but passing every one keeps
    the two models the same if bench/run.py's shape ever changes."""
    rope = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", None)
    return [
        "--layers",
        str(hf.num_hidden_layers),
        "--hidden",
        str(hf.hidden_size),
        "--intermediate",
        str(hf.intermediate_size),
        "--heads",
        str(hf.num_attention_heads),
        "--kv-heads",
        str(hf.num_key_value_heads),
        "--vocab",
        str(hf.vocab_size),
        "--rope-theta",
        str(rope or 1e6),
    ]


def _official_model_dir(hf) -> Path:
    # keyed by the shape so a later run reuses it (make_model.py keeps a directory it completed for the same
    # arguments); the full 28-layer model is ~15 GiB of bf16, so writing it once matters
    return Path(tempfile.gettempdir()) / (
        f"megatrain-official-qwen2-L{hf.num_hidden_layers}-H{hf.hidden_size}-I{hf.intermediate_size}"
        f"-A{hf.num_attention_heads}-KV{hf.num_key_value_heads}-V{hf.vocab_size}"
    )


def _stream(cmd: Sequence[str], cwd: str, tail: deque[str]) -> int:
    """Run cmd, echoing each output line with a prefix (a device log then shows its progress live) and keeping
    the last lines for the error message. Returns the exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        for line in proc.stdout or ():  # a pipe: stdout=PIPE above
            print(f"[official] {line.rstrip()}", flush=True)
            tail.append(line.rstrip())
    return proc.returncode


def _last_meaningful(lines: Sequence[str]) -> str:
    """The last line that says something: not the summary JSON, not a traceback's ~~~^^^ marker line."""
    for line in reversed(lines):
        text = line.strip()
        if text and not text.startswith("[bench] JSON ") and set(text) - set("~^ "):
            return text[:300]
    return "no output"


def _official_failure(reason: str, name: str) -> dict:
    oom = "OutOfMemoryError" in reason or "CUDA out of memory" in reason
    return {"name": name, "status": "OOM" if oom else f"error: {reason}"}


def _official_result(summ: dict, warmup: int, name: str) -> dict:
    """Our result dict from bench_official.py's JSON: their per-step wall times (their own perf_counter pair
    around the step, all steps: bench/run.py leaves out its warm-up) and their 6*N*B*S/t TFLOPS."""
    per = summ["per_step"]
    theirs = [s["tflops_theirs"] for s in per]
    kept = theirs[warmup:] or theirs
    # their GPU figure is max_memory_allocated / 1024**3, logged with 2 decimals: exact to about 10 MiB
    gpu_gib = max((s.get("gpu_peak_gb", 0.0) for s in per), default=0.0)
    return {
        "name": name,
        "status": "ok",
        "step_times_s": [s["t"] for s in per],
        "gpu_peak_bytes": int(gpu_gib * 2**30),
        "tflops_theirs_median": statistics.median(kept),
        "tflops_theirs_warmup_steps": warmup,
        "tflops_theirs_avg_all_steps": statistics.mean(theirs),  # = their own "Avg Throughput" line
        "tflops_theirs_per_step": theirs,
        "num_params_theirs": summ.get("N"),
        "attn": summ.get("attn"),
        "flash_ce": summ.get("flash_ce"),
        "cpu_adam": summ.get("cpu_adam"),
        "cpu_rss_peak_gib": max((s.get("cpu_rss_gb", 0.0) for s in per), default=0.0),
        "losses": [s.get("loss") for s in per],
    }


def official_megatrain(
    hf,
    data: DataConfig,
    steps: int,
    warmup: int = 2,
    src: Path | None = None,
    gpu_gib: float | None = None,
    init: Path | None = None,
) -> dict:
    """The official MegaTrain trainer (their checkout `src`, unmodified; default: official_src()) through our
    glue bench_official.py, on a random-initialised model of hf's shape and random tokens, batch and sequence as
    ours. A subprocess: their code sets process-wide state (logging, PYTORCH_CUDA_ALLOC_CONF) and pins its own
    host memory. No checkout raises MissingCheckout (bench/run.py checks before it measures anything).

    warmup only sets which steps tflops_theirs_median leaves out (bench/run.py's default --warmup). `init` (a saved
    init, --routing uniform) is a mixture of experts', which the official code does not train: refused."""
    src = src or official_src()
    name = f"official MegaTrain (DLYuanGod/MegaTrain {commit_of(src)})"
    if importlib.util.find_spec("deepspeed") is None:  # their default optimizer is DeepSpeedCPUAdam
        return {"name": name, "status": "not installed"}
    if init is not None:
        return _official_failure("it trains its own random init of the qwen2 family only", name)
    if hf.tie_word_embeddings:
        return _official_failure("make_model.py writes untied embeddings only", name)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand our cached blocks back so the subprocess gets the whole GPU
    try:
        return _official_run(hf, data, steps, warmup, src, name, gpu_gib)
    except Exception as exc:  # a peer that cannot run is reported, never raised into bench/run.py
        return _official_failure(f"{type(exc).__name__}: {str(exc)[:300]}", name)


def _official_run(
    hf, data: DataConfig, steps: int, warmup: int, src: Path, name: str, gpu_gib: float | None = None
) -> dict:
    """make_model.py (skipped when the directory is already complete), then bench_official.py; both streamed."""
    tail: deque[str] = deque(maxlen=200)
    with tempfile.TemporaryDirectory(prefix="official-") as tmp:
        model_dir = _official_model_dir(hf)
        cmd = [sys.executable, str(OFFICIAL_DIR / "make_model.py"), str(model_dir), *_official_model_args(hf)]
        if _stream(cmd, tmp, tail) != 0:
            return _official_failure(f"make_model.py: {_last_meaningful(tail)}", name)
        out = Path(tmp) / "official.json"
        cmd = [
            sys.executable,
            str(OFFICIAL_DIR / "bench_official.py"),
            "--src",
            str(src),
            "--model-dir",
            str(model_dir),
            "--batch-size",
            str(data.batch_size),
            "--seq",
            str(data.seq_len),
            "--steps",
            str(steps),
            "--json-out",
            str(out),
            *(["--gpu-gib", str(gpu_gib)] if gpu_gib is not None else []),
        ]
        rc = _stream(cmd, tmp, tail)
        summ = json.loads(out.read_text()) if out.is_file() else {}
    if rc != 0 or summ.get("error") or not summ.get("per_step"):
        reason = (summ.get("error") or "").strip() or _last_meaningful(tail)
        return _official_failure(f"{reason.splitlines()[0][:300]} (exit {rc})", name)
    return _official_result(summ, warmup, name)


PEERS = {"plain": plain_pytorch, "fsdp2": fsdp2_offload, "deepspeed": deepspeed_zero3, "official": official_megatrain}
