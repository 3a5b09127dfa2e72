"""`megatrain-launch plan CONFIG [overrides]`: host and GPU memory of a run, before anything is allocated.

Host: the shared-memory store part by part (ipc/protocol/plan.py, the very sizes the store owner will
create), the executor's pinned activation checkpoints, and the processes themselves (PSS outside the
store, measured on the H200: the executor 1.4 GiB with its CUDA context, each CPU role about 0.7 GiB).
GPU: the terms of megatrain/autosize.py's memory model at the sizes the run would choose, plus the
largest unit's weights and gradient. Both against what this machine has (RAM available, /dev/shm free,
the GPU's free memory), with a verdict and the settings that need less. The run itself refuses a plan
that does not fit before it allocates anything: the store owner checks the host part (ipc/shm.py
check_space), the auto sizes the GPU part.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megatrain.ipc.protocol import StoreSpec, checkpoint_host_bytes, plan_store
from megatrain.ipc.shm import HEADER_BYTES, gib, mem_available_bytes, shm_free_bytes
from megatrain.launch.config import Config, load_config
from megatrain.launch.placement import demands, describe_need

from megatrain import autosize
from megatrain.engine import resolve_engine
from megatrain.errors import ConfigError, ResourceError
from megatrain.model import build_spec

GIB = 2**30
PROCESS_BYTES = {"gpu-executor": int(1.4 * GIB), "cpu-role": int(0.7 * GIB), "reaper": int(0.01 * GIB)}


@dataclass
class MemPlan:
    title: str
    host: dict[str, int]
    ram: int  # MemAvailable here
    shm: int  # free in ipc.shm_dir here
    shm_part: int  # what of the host lives in shared memory
    gpu: dict[str, int] = field(default_factory=dict)
    gpu_free: int | None = None
    gpu_note: str = ""
    sizes: str = ""
    gpu_error: str = ""
    need: str = ""  # what the actors ask of one node (launch/placement.py)

    def host_fits(self) -> bool:
        return sum(self.host.values()) <= self.ram and self.shm_part <= self.shm

    def gpu_fits(self) -> bool:
        return not self.gpu_error and (self.gpu_free is None or sum(self.gpu.values()) <= self.gpu_free)

    def fits(self) -> bool:
        return self.host_fits() and self.gpu_fits()


def make_plan(cfg: Config, gpu_free: int | None, cuda: bool) -> MemPlan:
    engine = resolve_engine(cfg.engine, cuda)
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    d = cfg.data
    gpu_error = ""
    try:
        sizes, why = autosize.choose(spec, engine, d.batch_size, d.seq_len, gpu_free if cuda else None,
                                     cfg.optim.clips)
    except ResourceError as exc:
        gpu_error, why = str(exc), ""
        sizes = autosize.Sizes(1, 1, 1, 512, 1)  # the least the engine can do, to show the rest of the plan
    engine = autosize.apply(engine, sizes)
    pinned = checkpoint_host_bytes(spec, engine, d.batch_size, d.seq_len)
    store = plan_store("plan", spec, engine.compute_dtype, engine.checkpoint_interval, cfg.actors.num_packers,
                       cfg.actors.num_accumulators, cfg.ipc, cuda, cfg.optim.clips,
                       {"checkpoints": pinned}, engine.last_block_layers)
    host = {f"shm: {k}": v + HEADER_BYTES for k, v in store.part_bytes().items()}
    host["executor: pinned activation checkpoints"] = pinned
    host.update(_processes(store, cfg, cuda))
    plan = MemPlan(f"{spec.family}, {spec.layout.num_layers} layers, {spec.layout.num_params / 1e6:.2f}M params, "
                   f"{d.batch_size}x{d.seq_len} tokens per step, engine on {engine.device} ({engine.compute_dtype}), "
                   f"staging {store.staging_mode}, clipping {'on' if store.clip else 'off'}",
                   host, mem_available_bytes(), shm_free_bytes(cfg.ipc.shm_dir),
                   sum(v for k, v in host.items() if k.startswith("shm:")), gpu_error=gpu_error)
    plan.need = describe_need(demands(cfg.actors, cuda, store.clip, cfg.train.saves_checkpoints))
    plan.sizes = str(sizes) + (f" ({why})" if why else "")
    if cuda:
        plan.gpu = autosize.gpu_terms(spec, engine, d.batch_size, d.seq_len, sizes)
        plan.gpu_free = gpu_free
    return plan


def _processes(store: StoreSpec, cfg: Config, cuda: bool) -> dict[str, int]:
    """Each process's own memory; packers run only with slabs, accumulators only with clipping, the writer
    only when checkpoints are written."""
    out = {"process: gpu-executor": PROCESS_BYTES["gpu-executor"] if cuda else PROCESS_BYTES["cpu-role"],
           "process: store-owner": PROCESS_BYTES["cpu-role"], "process: reaper": PROCESS_BYTES["reaper"]}
    roles = (["adam-updater"] + [f"packer-{i}" for i in range(store.running_packers)]
             + [f"grad-accumulator-{i}" for i in range(store.running_accumulators)]
             + (["checkpoint-writer"] if cfg.train.saves_checkpoints else []))
    out.update({f"process: {role}": PROCESS_BYTES["cpu-role"] for role in roles})
    return out


def suggestions(plan: MemPlan, cfg: Config) -> list[str]:
    """The settings that make a plan that does not fit need less, with what each saves."""
    tips = []
    if not plan.host_fits():
        for k, v in plan.host.items():
            if k == "shm: grads" and v:
                tips.append(f"optim.max_grad_norm=0: no clipping, no fp32 gradient plane (-{gib(v)} of host RAM)")
            if k == "shm: resident" and v:
                tips.append(f"ipc.staging=slabs: no resident copy (-{gib(v)} of host RAM; packing on the step's path)")
            if k.startswith("executor:") and v:
                tips.append(f"engine.offload_checkpoints=false or a larger engine.checkpoint_interval (-up to {gib(v)} "
                            "of host RAM; the checkpoints then take GPU memory)")
    if not plan.gpu_fits():
        tips += ["engine.chunk_sequences=1 (the batch through each layer one sequence at a time)",
                 "engine.checkpoint_interval=1 and engine.last_block_layers=1 (the fewest layers' activations kept)",
                 "engine.loss_chunk_tokens=1024 (smaller logits)", "a shorter data.seq_len"]
    return tips


def render(plan: MemPlan, cfg: Config) -> str:
    lines = [f"memory plan: {plan.title}", f"engine sizes: {plan.sizes}", "",
             f"host: {gib(sum(plan.host.values()))} needed; this machine: {gib(plan.ram)} RAM available, "
             f"{gib(plan.shm)} free in {cfg.ipc.shm_dir} (the store needs {gib(plan.shm_part)} there)"]
    lines += [f"  {k:<52} {gib(v):>12}" for k, v in plan.host.items() if v]
    lines.append(f"  -> {'fits' if plan.host_fits() else 'DOES NOT FIT'}")
    if plan.gpu:
        have = f"{gib(plan.gpu_free)} free on this machine's GPU" if plan.gpu_free is not None else "no GPU here"
        lines += ["", f"GPU: {gib(sum(plan.gpu.values()))} at the peak; {have}{plan.gpu_note}"]
        lines += [f"  {k:<52} {gib(v):>12}" for k, v in plan.gpu.items()]
        lines.append(f"  -> {'fits' if plan.gpu_fits() else 'DOES NOT FIT'}" + (f": {plan.gpu_error}" if plan.gpu_error
                                                                                  else ""))
    lines += ["", f"Ray: the actors ask for {plan.need}"]
    lines += ["", "verdict: " + ("fits" if plan.fits() else "does not fit")]
    tips = suggestions(plan, cfg)
    if tips:
        lines += ["settings that need less:"] + [f"  {t}" for t in tips]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatrain-launch plan",
                                description="Host and GPU memory of a run, against this machine, before anything "
                                            "is allocated. Exit 0 when it fits, 1 when it does not.")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--gpu-gib", type=float, help="plan for a GPU with this much free memory (default: this "
                                                 "machine's GPU; without one, the CPU device)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    free, cuda, note = _gpu(cfg, args.gpu_gib)
    plan = make_plan(cfg, free, cuda)
    plan.gpu_note = note
    print(render(plan, cfg))
    return 0 if plan.fits() else 1


def _gpu(cfg: Config, gib_given: float | None) -> tuple[int | None, bool, str]:
    if cfg.engine.device == "cpu":
        if gib_given is not None:
            raise ConfigError("--gpu-gib plans for a GPU, but engine.device is cpu")
        return None, False, ""
    if gib_given is not None:
        if gib_given <= 0:
            raise ConfigError("--gpu-gib must be > 0")
        return int(gib_given * GIB), True, " (--gpu-gib)"
    import torch

    if not torch.cuda.is_available():
        if cfg.engine.device == "cuda":
            raise ConfigError("engine.device is cuda but this machine has no GPU: give --gpu-gib N to plan for "
                              "a GPU with N GiB free")
        return None, False, ""
    free, _ = torch.cuda.mem_get_info()
    return free, True, " (a run measures it again in its executor, after its CUDA context)"

