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
import dataclasses
import math
import os
from dataclasses import dataclass, field

from megatrain import autosize, gpubudget
from megatrain.engine import EngineConfig, fixed_sizes, resolve_engine
from megatrain.errors import ConfigError, ResourceError
from megatrain.flops import active_params, expert_params
from megatrain.ipc.protocol import StoreSpec, checkpoint_host_bytes, plan_store
from megatrain.ipc.protocol.reduce import reduction_bytes
from megatrain.ipc.shm import (
    HEADER_BYTES,
    RAY_DEFAULT_THRESHOLD,
    RAY_THRESHOLD_ENV,
    gib,
    mem_available_bytes,
    mem_total_bytes,
    monitor_room,
    shm_free_bytes,
)
from megatrain.launch.config import timeplan
from megatrain.launch.config.tree import Config, load_tree, validate_model
from megatrain.launch.control.cluster import PRIVATE_THRESHOLD
from megatrain.launch.control.placement import demands, describe_need, per_executor, resolve_executors
from megatrain.model import ModelSpec, build_spec
from megatrain.moe import is_moe, num_experts
from megatrain.weights import holds_weights

GIB = 2**30
PROCESS_BYTES = {
    "gpu-executor": int(1.4 * GIB),
    "cpu-role": int(0.7 * GIB),
    "reaper": int(0.01 * GIB),
    "driver": int(1.0 * GIB),
    "ray": int(0.8 * GIB),
}  # the launcher; Ray's own processes


@dataclass
class Host:
    """The host a plan is made for: this machine now, or one of `--host-gib` GiB."""

    ram: int  # MemAvailable
    total: int  # MemTotal
    shm: int  # free in ipc.shm_dir
    threshold: float | None  # Ray's memory monitor (fraction of RAM in use); None: no Ray
    note: str = ""

    @property
    def limit(self) -> int:
        """What the run may take: what is available, less what Ray's memory monitor keeps free."""
        room = monitor_room(self.ram, self.threshold, self.total)
        return self.ram if room is None else min(self.ram, room)


@dataclass
class MemPlan:
    title: str
    host: dict[str, int]
    machine: Host
    shm_part: int  # what of the host lives in shared memory
    num_params: int = 0
    active_params: int = 0  # what a token computes with (megatrain/flops.py); num_params for a dense model
    expert_params: int = 0  # the routed experts' tensors, all of them; 0 for a dense model
    gpu: dict[str, int] = field(default_factory=dict)
    gpu_free: int | None = None
    gpu_budget: int | None = None  # engine.gpu_memory_gib less the CUDA context; None: no budget
    budget_note: str = ""
    gpu_note: str = ""
    sizes: str = ""
    gpu_error: str = ""
    need: str = ""  # what the actors ask of one node (launch/control/placement.py)
    cuda: bool = False

    def run_pss(self) -> int:
        """What the run's own processes take (their PSS, the store counted once): the plan's host part less
        what the node spends on it besides ("node:" terms), which a run's own PSS report leaves out."""
        return sum(v for k, v in self.host.items() if not k.startswith("node:"))

    def host_fits(self) -> bool:
        return sum(self.host.values()) <= self.machine.limit and self.shm_part <= self.machine.shm

    @property
    def gpu_limit(self) -> int | None:
        """What the run may take of the GPU: its free memory, capped at the budget."""
        known = [v for v in (self.gpu_free, self.gpu_budget) if v is not None]
        return min(known) if known else None

    def gpu_fits(self) -> bool:
        limit = self.gpu_limit
        return not self.gpu_error and (limit is None or sum(self.gpu.values()) <= limit)

    def fits(self) -> bool:
        return self.host_fits() and self.gpu_fits()


def this_host(cfg: Config, host_gib: float | None = None) -> Host:
    """This machine (or, with `host_gib`, one with that much RAM, all of it free and /dev/shm as large), with
    the memory-monitor threshold the run's Ray would have: the user's RAY_memory_usage_threshold, else a
    private instance's, else (joining a cluster) Ray's default; none with the in-process runner."""
    if cfg.launch.runner == "inprocess":
        threshold = None
    elif RAY_THRESHOLD_ENV in os.environ:
        threshold = float(os.environ[RAY_THRESHOLD_ENV])
    elif cfg.launch.address or os.environ.get("RAY_ADDRESS"):
        threshold = RAY_DEFAULT_THRESHOLD
    else:
        threshold = PRIVATE_THRESHOLD
    if host_gib is not None:
        if host_gib <= 0:
            raise ConfigError("--host-gib must be > 0")
        size = int(host_gib * GIB)
        return Host(size, size, size, threshold, " (--host-gib: all of it free, /dev/shm as large)")
    return Host(mem_available_bytes(), mem_total_bytes(), shm_free_bytes(cfg.ipc.shm_dir), threshold)


# Pinned checkpoints are optional host memory (the GPU takes those the host does not): they stop this far
# below the run's limit, so that the processes' transient allocations and the planning error (about half a
# GiB at the 7B's 512K run) do not take the node over Ray's kill line.
CHECKPOINT_HEADROOM_FRACTION = 0.02


def host_room(cfg: Config, spec: ModelSpec, cuda: bool, machine: Host) -> int:
    """Host RAM left for the executor's pinned activation checkpoints on `machine`: its limit less the store
    (as planned without them), the processes, the node's share and a headroom (autosize.choose places the
    rest on the GPU)."""
    engine = fixed_sizes(resolve_engine(cfg.engine, cuda))
    _, host = _host_terms(cfg, spec, engine, cuda, machine, 0)
    headroom = int(machine.limit * CHECKPOINT_HEADROOM_FRACTION)
    return machine.limit - headroom - sum(host.values())


def _host_terms(
    cfg: Config, spec: ModelSpec, engine: EngineConfig, cuda: bool, machine: Host, pinned: int
) -> tuple[StoreSpec, dict[str, int]]:
    """The store the run would make on `machine` and the host memory of the run, term by term."""
    store = plan_store(
        "plan",
        spec,
        engine.compute_dtype,
        engine.checkpoint_interval,
        cfg.actors.num_packers,
        cfg.actors.num_accumulators,
        cfg.ipc,
        cuda,
        cfg.optim.clips,
        {"checkpoints": pinned},
        engine.last_block_layers,
        space=(machine.shm, machine.limit),
        executors=executors_of(cfg, cuda),
    )
    host = {f"shm: {k}": v + HEADER_BYTES for k, v in store.part_bytes().items()}
    host["executor: pinned activation checkpoints"] = pinned
    host.update(_processes(store, cfg, cuda))
    host["node: page tables of the store's mappings"] = store.page_table_bytes()
    return store, host


def executors_of(cfg: Config, cuda: bool) -> int:
    """actors.num_gpus for the plan, as given (the plan may be for another machine); auto is this machine's
    GPUs, and a planned GPU (--gpu-gib) without one here counts as one."""
    if cfg.actors.num_gpus != "auto":
        return int(cfg.actors.num_gpus)
    import torch

    return resolve_executors(cfg.actors, cuda, max(torch.cuda.device_count(), 1) if cuda else 0)


def make_plan(cfg: Config, gpu_free: int | None, cuda: bool, machine: Host | None = None) -> MemPlan:
    engine = resolve_engine(cfg.engine, cuda)
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    d = cfg.data
    gpu_error = ""
    machine = machine or this_host(cfg)
    n = executors_of(cfg, cuda)
    room = host_room(cfg, spec, cuda, machine) // n if cuda else None  # each executor pins its own checkpoints
    batch = per_executor(d.batch_size, n)  # each executor's GPU holds its share of the batch
    sized, budget_note = gpubudget.planning_room(engine, gpu_free) if cuda else (None, "")
    if sized is not None and n > 1:
        sized -= reduction_bytes(spec)  # beside the activations, as the run's choose_sizes() leaves it
    try:
        sizes, why = autosize.choose(spec, engine, batch, d.seq_len, sized, cfg.optim.clips, room)
    except ResourceError as exc:
        gpu_error, why = str(exc), ""
        sizes = autosize.Sizes(1, 1, 1, 512, 1)  # the least the engine can do, to show the rest of the plan
    engine = autosize.apply(engine, sizes)
    pinned = n * checkpoint_host_bytes(spec, engine, batch, d.seq_len)
    store, host = _host_terms(cfg, spec, engine, cuda, machine, pinned)
    active, experts = active_params(spec), expert_params(spec)
    plan = MemPlan(
        f"{_params(spec, active, experts)}, "
        f"{d.batch_size}x{d.seq_len} tokens per step"
        + (f" over {n} executors (at most {batch} sequences each)" if n > 1 else "")
        + f", engine on {engine.device} ({engine.compute_dtype}), "
        f"staging {store.staging_mode}, clipping {'on' if store.clip else 'off'}",
        host,
        machine,
        sum(v for k, v in host.items() if k.startswith("shm:")),
        spec.layout.num_params,
        active,
        experts,
        gpu_error=gpu_error,
        cuda=cuda,
    )
    plan.need = describe_need(
        demands(cfg.actors, cuda, store.clip, cfg.train.saves_checkpoints, store.staging_mode, executors=n)
    )
    plan.sizes = str(sizes) + (f" ({why})" if why else "")
    if cuda:
        plan.gpu = autosize.gpu_terms(spec, engine, batch, d.seq_len, sizes)
        if n > 1:
            plan.gpu["fp32 gradients awaiting the executors' sum"] = reduction_bytes(spec)
        plan.gpu_free = gpu_free
        budget = gpubudget.budget_bytes(engine)
        plan.gpu_budget = None if budget is None else budget - gpubudget.CONTEXT_BYTES
        plan.budget_note = budget_note
    return plan


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _params(spec: ModelSpec, active: int, experts: int) -> str:
    """The title's model part: family, layers, parameters; of a mixture of experts also the active
    parameters per token and the routed experts' (`active`, `experts`: flops.py's counts)."""
    head = f"{spec.family}, {spec.layout.num_layers} layers"
    hf = spec.hf_config
    if not is_moe(hf):
        return f"{head}, {spec.layout.num_params / 1e6:.2f}M params"
    shared = ", plus a shared expert" if getattr(hf, "shared_expert_intermediate_size", 0) else ""
    return (
        f"{head}, {_count(spec.layout.num_params)} params ({_count(active)} active per token; "
        f"experts {_count(experts)}: {num_experts(hf)} per layer, top-{hf.num_experts_per_tok}{shared})"
    )


def _processes(store: StoreSpec, cfg: Config, cuda: bool) -> dict[str, int]:
    """Each process's own memory; packers run only with slabs, accumulators only with clipping, the writer
    only when checkpoints are written."""
    executor = PROCESS_BYTES["gpu-executor"] if cuda else PROCESS_BYTES["cpu-role"]
    out = {
        "process: gpu-executor": executor,
        **{f"process: gpu-executor-{r}": executor for r in range(1, store.num_executors)},
        "process: store-owner": PROCESS_BYTES["cpu-role"],
        "process: reaper": PROCESS_BYTES["reaper"],
    }
    roles = (
        ["adam-updater"]
        + [f"packer-{i}" for i in range(store.running_packers)]
        + [f"grad-accumulator-{i}" for i in range(store.running_accumulators)]
        + (["checkpoint-writer"] if cfg.train.saves_checkpoints else [])
    )
    out.update({f"process: {role}": PROCESS_BYTES["cpu-role"] for role in roles})
    if cfg.launch.runner != "inprocess":  # the launcher itself, and a private Ray instance's processes
        out["node: the launcher (megatrain-launch)"] = PROCESS_BYTES["driver"]
        if not (cfg.launch.address or os.environ.get("RAY_ADDRESS")):
            out["node: Ray's own processes (raylet, GCS, agents)"] = PROCESS_BYTES["ray"]
    return out


# Settings that take host memory away, each re-planned to show what it saves on this model and machine.
HOST_LEVERS = [
    ("optim.max_grad_norm=0", "no clipping", lambda c: _set(c, "optim", max_grad_norm=0.0)),
    ("ipc.staging=slabs", "no resident copy; packing on the step's path", lambda c: _set(c, "ipc", staging="slabs")),
    (
        "optim.max_grad_norm=0 ipc.staging=slabs",
        "no clipping, no resident copy: 12 bytes per parameter of planes",
        lambda c: _set(_set(c, "optim", max_grad_norm=0.0), "ipc", staging="slabs"),
    ),
    (
        "optim.max_grad_norm=0 ipc.staging=slabs ipc.slab_params=QUARTER",
        "no clipping, no resident copy, slabs of a quarter layer",
        lambda c: _set(_set(c, "optim", max_grad_norm=0.0), "ipc", staging="slabs", slab_params=_quarter_layer(c)),
    ),
    (
        "engine.offload_checkpoints=false",
        "the activation checkpoints in GPU memory instead",
        lambda c: _set(c, "engine", offload_checkpoints=False),
    ),
]


def _quarter_layer(cfg: Config) -> int:
    layout = build_spec(cfg.model, cfg.optim.no_decay_1d).layout
    return max(max(layout.structure_of(u.index).numel for u in layout.units if u.kind == "layer") // 4, 1)


def _set(cfg: Config, part: str, **values) -> Config:
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **values)})


def suggestions(plan: MemPlan, cfg: Config) -> list[str]:
    """The settings that make a plan that does not fit need less, with what each saves (host: re-planned)."""
    tips = []
    if not plan.host_fits():
        total, least, fits = sum(plan.host.values()), _least_host(plan), False
        for setting, what, change in HOST_LEVERS:
            other = make_plan(change(cfg), plan.gpu_free, plan.cuda, plan.machine)
            saved = total - sum(other.host.values())
            if saved > 0:
                setting = setting.replace("QUARTER", str(_quarter_layer(cfg)))
                tips.append(f"{setting}: {what} (-{gib(saved)} of host RAM)")
                fits, least = fits or other.host_fits(), min(least, _least_host(other))
        if not fits:
            tips.append(_host_needed(plan, least))
    if not plan.gpu_fits():
        tips += [
            "engine.chunk_sequences=1 (the batch through each layer one sequence at a time)",
            "engine.checkpoint_interval=1 and engine.last_block_layers=1 (the fewest layers' activations kept)",
            "engine.loss_chunk_tokens=1024 (smaller logits)",
            "a shorter data.seq_len",
        ]
        least = _set(
            cfg, "engine", chunk_sequences=1, checkpoint_interval=1, last_block_layers=1, loss_chunk_tokens=1024
        )
        if not make_plan(least, plan.gpu_free, plan.cuda, plan.machine).gpu_fits():
            tips.append(
                "none of the engine settings makes it fit this GPU, not even all of them at once: only a shorter "
                "data.seq_len or a GPU with more memory does"
            )
    return tips


def _least_host(plan: MemPlan) -> int:
    """A plan's host need without its pinned activation checkpoints (the GPU takes those the host does not)."""
    return sum(plan.host.values()) - plan.host.get("executor: pinned activation checkpoints", 0)


def _host_needed(plan: MemPlan, least: int) -> str:
    """What makes a plan fit where no setting does: the RAM of a host (all of it free) that holds `least`."""
    m = plan.machine
    share = m.threshold if m.threshold is not None else 1.0  # what Ray's monitor lets a run take of the RAM
    ram = math.ceil(least / share / GIB)
    return (
        f"none of these makes it fit {'this machine' if not m.note else 'that host'}: the least of them needs "
        f"{gib(least)} of host RAM, and the run may take {gib(max(m.limit, 0))}; it fits a host with "
        f"{ram} GiB of RAM, all of it free (--host-gib {ram} plans for one)"
    )


def render(plan: MemPlan, cfg: Config, extra: list[str] | None = None) -> str:
    """The plan as printed; `extra` lines (the time estimate) come before the verdict."""
    m, total = plan.machine, sum(plan.host.values())
    # per parameter where the parameters dominate (a tiny model's bytes are the processes')
    run = plan.run_pss()
    per_param = f", {run / plan.num_params:.1f} bytes per parameter" if plan.num_params >= 10**8 else ""
    lines = [
        f"memory plan: {plan.title}",
        f"engine sizes: {plan.sizes}",
        "",
        f"host: {gib(total)} needed (the run's processes {gib(run)}{per_param}; the rest is the node's); "
        f"this machine{m.note}: {gib(m.ram)} RAM available, "
        f"{gib(m.shm)} free in {cfg.ipc.shm_dir} (the store needs {gib(plan.shm_part)} there)",
    ]
    if m.threshold is not None:
        lines.append(
            f"  Ray's memory monitor kills workers above {m.threshold:.0%} of {gib(m.total)} RAM in use "
            f"({RAY_THRESHOLD_ENV}; {PRIVATE_THRESHOLD:.0%} in a private instance): the run may take "
            f"{gib(max(m.limit, 0))}"
        )
    lines += [f"  {k:<52} {gib(v):>12}" for k, v in plan.host.items() if v]
    lines.append(f"  -> {'fits' if plan.host_fits() else 'DOES NOT FIT'}")
    if plan.gpu:
        have = f"{gib(plan.gpu_free)} free on this machine's GPU" if plan.gpu_free is not None else "no GPU here"
        lines += ["", f"GPU: {gib(sum(plan.gpu.values()))} at the peak; {have}{plan.gpu_note}"]
        if plan.budget_note:
            lines.append(f"  budget: {plan.budget_note}")
        lines += [f"  {k:<52} {gib(v):>12}" for k, v in plan.gpu.items()]
        lines.append(
            f"  -> {'fits' if plan.gpu_fits() else 'DOES NOT FIT'}" + (f": {plan.gpu_error}" if plan.gpu_error else "")
        )
        lines.append(f"  {least_gpu(plan, cfg)}")
    lines += ["", *_disk(cfg)]
    lines += ["", f"Ray: the actors ask for {plan.need}"]
    lines += ["", *extra] if extra else []
    lines += ["", "verdict: " + ("fits" if plan.fits() else "does not fit")]
    tips = suggestions(plan, cfg)
    if tips:
        lines += ["settings that need less:"] + [f"  {t}" for t in tips]
    return "\n".join(lines)


def least_gpu(plan: MemPlan, cfg: Config) -> str:
    """The least GPU memory with which the plan fits, as free memory and as engine.gpu_memory_gib."""
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    engine = resolve_engine(cfg.engine, True)
    n = executors_of(cfg, True)
    reserve = reduction_bytes(spec) if n > 1 else 0
    room = host_room(cfg, spec, True, plan.machine) // n
    least = gpubudget.least_room(
        spec, engine, per_executor(cfg.data.batch_size, n), cfg.data.seq_len, cfg.optim.clips, room, reserve
    )
    if least is None:
        return "no GPU holds the engine sizes set: set them auto"
    return (
        f"the least GPU memory for this run: {gib(least)} free after the CUDA context, "
        f"{gpubudget.KEY} {(least + gpubudget.CONTEXT_BYTES) / GIB:.1f}"
    )


def _disk(cfg: Config) -> list[str]:
    """The checkpoints' disk against the output directory's free space (a warning; the verdict is memory's)."""
    from megatrain.launch.config.diskplan import disk_lines
    from megatrain.launch.run.outdir import resolve_output

    total = build_spec(cfg.model, cfg.optim.no_decay_1d).layout.total
    out = resolve_output(cfg.train.output_dir, cfg.train.run_id or "{run_id}")
    return disk_lines(cfg.train, out, 4 * total * 3, 4 * total)  # three fp32 planes; the fp32 weights


def report(args: argparse.Namespace) -> int:
    """Print the plan of launch/cli/plan_cmd.py's arguments; 0 when it fits, 1 when it does not."""
    cfg, where = load_tree(args.config, args.overrides)
    validate_model(cfg, where, weights=False)  # planning comes before the download: config.json is enough
    free, cuda, note = _gpu(cfg, args.gpu_gib)
    plan = make_plan(cfg, free, cuda, this_host(cfg, args.host_gib))
    plan.gpu_note = note
    engine, n = resolve_engine(cfg.engine, cuda), executors_of(cfg, cuda)
    asked = timeplan.Asked(args.gpu, args.gpu_tflops, args.gpu_gib is not None, args.host_gib is not None)
    timing = timeplan.plan_lines(cfg, engine, n, asked)
    print(render(plan, cfg, timing + _weights_note(cfg)))
    return 0 if plan.fits() else 1


def _weights_note(cfg: Config) -> list[str]:
    if not cfg.model.pretrained or holds_weights(cfg.model.pretrained):
        return []
    return [
        f"model.pretrained: '{cfg.model.pretrained}' holds config.json but no weights yet (model.safetensors or a "
        "sharded index): planned from config.json; a run refuses it until the weights are there"
    ]


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
        if gpubudget.budget_bytes(cfg.engine) is not None:  # a GPU of that budget, wherever it will be
            return None, True, f" (planned for {gpubudget.KEY})"
        if cfg.engine.device == "cuda":
            raise ConfigError(
                "engine.device is cuda but this machine has no GPU: give --gpu-gib N to plan for a GPU with N GiB free"
            )
        return None, False, ""
    free, _ = torch.cuda.mem_get_info()
    return free, True, " (a run measures it again in its executor, after its CUDA context)"
