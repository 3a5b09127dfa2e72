"""`megatrain-launch plan CONFIG [overrides]`: the run's memory plan (launch/config/memplan.py), rendered: the
host and GPU parts with a verdict, the settings that need less (each re-planned on this model and machine), the
hosts a run needs, the disk and the step time (launch/config/timeplan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from megatrain.config.engine import resolve_engine
from megatrain.errors import ConfigError, human_bytes
from megatrain.ipc.shared.shm import gib
from megatrain.launch.config import timeplan
from megatrain.launch.config.memplan import (
    MemPlan,
    arch_of,
    executors_of,
    host_room,
    make_plan,
    this_host,
)
from megatrain.launch.config.tree import Config, gpu_budget_without_gpu, load_tree, validate_plan
from megatrain.launch.control.placement import per_executor
from megatrain.memory import budget as gpubudget
from megatrain.memory.autosize import PLAN_HINT, SEQ_ADVICE
from megatrain.memory.gpu import reduction_bytes
from megatrain.memory.hosts import fewest_hosts, host_plane_elems
from megatrain.memory.machine import (
    GIB,
    PRIVATE_THRESHOLD,
    RAY_THRESHOLD_ENV,
    local_gpus,
)
from megatrain.model.arch import holds_weights

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
    layout = arch_of(cfg).layout
    return max(max(layout.structure_of(u.index).numel for u in layout.units if u.kind == "layer") // 4, 1)


def _set(cfg: Config, part: str, **values) -> Config:
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **values)})


def suggestions(plan: MemPlan, cfg: Config) -> list[str]:
    """The settings that make a plan that does not fit need less, with what each saves (host: re-planned)."""
    tips = []
    if not plan.host_fits():
        total, least, fits = sum(plan.host.values()), plan.memory.least_host(), False
        for setting, what, change in HOST_LEVERS:
            try:
                other = make_plan(change(cfg), plan.gpu_free, plan.cuda, plan.machine, plan.hosts)
            except ConfigError:  # a lever this run cannot take (slabs beside several executors or hosts)
                continue
            saved = total - sum(other.host.values())
            if saved > 0:
                setting = setting.replace("QUARTER", str(_quarter_layer(cfg)))
                tips.append(f"{setting}: {what} (-{gib(saved)} of host RAM)")
                fits, least = fits or other.host_fits(), min(least, other.memory.least_host())
        if not fits:
            tips.append(_host_needed(plan, least, bool(tips)))
    if not plan.gpu_fits():
        least = _set(
            cfg, "engine", chunk_sequences=1, checkpoint_interval=1, last_block_layers=1, loss_chunk_tokens=1024
        )
        if make_plan(least, plan.gpu_free, plan.cuda, plan.machine, plan.hosts).gpu_fits():
            tips += [
                "engine.chunk_sequences=1 (the batch through each layer one sequence at a time)",
                "engine.checkpoint_interval=1 and engine.last_block_layers=1 (the fewest layers' activations kept)",
                "engine.loss_chunk_tokens=1024 (smaller logits)",
                "a shorter data.seq_len",
            ]
        else:  # the settings above would be listed for nothing
            tips.append(
                "none of the engine settings makes it fit this GPU, not even all of them at once: only a shorter "
                "data.seq_len or a GPU with more memory does"
            )
    return tips


def _host_needed(plan: MemPlan, least: int, levers: bool = True) -> str:
    """What makes a plan fit where no setting does: the RAM of a host (all of it free) that holds `least`;
    `levers`: whether settings were listed before it."""
    m = plan.machine
    share = m.threshold if m.threshold is not None else 1.0  # what Ray's monitor lets a run take of the RAM
    ram = math.ceil(least / share / GIB)
    none = "none of these makes" if levers else "no setting makes"
    return (
        f"{none} it fit {'this machine' if not m.note else 'that host'}: the least {'of them ' if levers else ''}needs "
        f"{gib(least)} of host RAM, and the run may take {gib(max(m.limit, 0))}; it fits a host with "
        f"{ram} GiB of RAM, all of it free (--host-gib {ram} plans for one)"
    )


def _hosts_needed(plan: MemPlan, cfg: Config) -> str:
    """The fewest hosts like this one on which the plan's host part fits, with what each then needs."""
    plans: dict[int, MemPlan] = {}

    # several hosts take the resident copy whatever ipc.staging asks (slabs would be refused there)
    several = _set(cfg, "ipc", staging="auto") if cfg.ipc.staging == "slabs" else cfg

    def fits(hosts: int) -> bool:
        plans[hosts] = make_plan(several, plan.gpu_free, plan.cuda, plan.machine, hosts)
        return plans[hosts].host_fits()

    like = "this one" if not plan.machine.note else "that one"
    hosts = fewest_hosts(fits, plan.hosts + 1)
    if hosts is None:
        most = max(plans, default=plan.hosts)  # the most hosts tried (none beyond MAX_HOSTS)
        need = sum(plans.get(most, plan).host.values())
        return (
            f"no number of hosts like {like} fits it: on {most} (--hosts {most}) each still needs "
            f"{gib(need)} (what every host keeps whole: the resident copy, the staging slabs, the processes)"
        )
    return (
        f"on {hosts} hosts like {like} (--hosts {hosts}, actors.num_hosts={hosts}) each needs "
        f"{gib(sum(plans[hosts].host.values()))}: fits"
    )


def _one_of(plan: MemPlan, before: str = "") -> str:
    """Which host the plan is of a run over several (`before` it, the words that lead to it): the hosts are
    alike, so it is the first's, numbered as the run numbers them (ROLE@host0 is the first); nothing for one
    host."""
    return f"{before} 0 of {plan.hosts}" if plan.hosts > 1 else ""


def render(plan: MemPlan, cfg: Config, extra: list[str] | None = None) -> str:
    """The plan as printed; `extra` lines (the time estimate) come before the verdict."""
    m, total = plan.machine, sum(plan.host.values())
    # per parameter where the parameters dominate (a tiny model's bytes are the processes')
    run = plan.run_pss()
    per_param = f", {run / plan.num_params:.1f} bytes per parameter" if plan.num_params >= 10**8 else ""
    lines = [
        f"memory plan{_one_of(plan, ' of host')}: {plan.title}",
        f"engine sizes: {plan.sizes}",
        "",
        f"host{_one_of(plan)}: {gib(total)} needed (the run's processes {gib(run)}{per_param}; the rest is "
        f"the node's); {_machine(plan)}: {gib(m.ram)} RAM available, "
        f"{gib(m.shm)} free in {cfg.ipc.shm_dir} (the store needs {gib(plan.memory.shm_part)} there)",
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
        gpu = "the GPU" if plan.gpu_note.startswith(" (--gpu") else "this machine's GPU"  # another's: --gpu(-gib)
        have = f"{gib(plan.gpu_free)} free on {gpu}" if plan.gpu_free is not None else "no GPU here"
        lines += ["", f"GPU: {gib(sum(plan.gpu.values()))} at the peak; {have}{plan.gpu_note}"]
        if plan.memory.gpu.budget_note:
            lines.append(f"  budget: {plan.memory.gpu.budget_note}")
        lines += [f"  {k:<52} {gib(v):>12}" for k, v in plan.gpu.items()]
        lines.append(
            f"  -> {'fits' if plan.gpu_fits() else 'DOES NOT FIT'}"
            + (f": {_gpu_error(plan)}" if plan.gpu_error else "")
        )
        lines.append(f"  {least_gpu(plan, cfg)}")
    lines += ["", *_disk(cfg, plan.hosts)]
    lines += ["", f"Ray: the actors ask for {plan.need}"]
    lines += ["", *extra] if extra else []
    lines += ["", f"verdict{_one_of(plan, ' for host')}: " + ("fits" if plan.fits() else "does not fit")]
    lines += [] if plan.host_fits() else [_hosts_needed(plan, cfg)]
    tips = suggestions(plan, cfg)
    if tips:
        lines += ["settings that need less:"] + [f"  {t}" for t in tips]
    return "\n".join(lines)


def _gpu_error(plan: MemPlan) -> str:
    """Why the GPU does not fit, less the way out (the suggestions say it) and the pointer to the plan (this)."""
    return plan.gpu_error.removesuffix(PLAN_HINT).removesuffix(SEQ_ADVICE)


def least_gpu(plan: MemPlan, cfg: Config) -> str:
    """The least GPU memory with which the plan fits, as free memory and as engine.gpu_memory_gib."""
    arch = arch_of(cfg)
    engine = resolve_engine(cfg.engine, True)
    n = executors_of(cfg, True)
    reserve = reduction_bytes(arch.layout, plan.hosts) if n > 1 or plan.hosts > 1 else 0
    room = (host_room(cfg, arch, True, plan.machine, plan.hosts) or 0) // n
    least = gpubudget.least_room(
        arch,
        engine,
        per_executor(cfg.data.batch_size, n * plan.hosts),
        cfg.data.seq_len,
        cfg.optim.clips,
        room,
        reserve,
    )
    if least is None:
        return "no GPU holds the engine sizes set: set them auto"
    return (
        f"the least GPU memory for this run: {gib(least)} free after the CUDA context, "
        f"{gpubudget.KEY} {(least + gpubudget.CONTEXT_BYTES) / GIB:.1f}"
    )


def _machine(plan: MemPlan) -> str:
    """The machine the plan is against, as the host line names it."""
    m = plan.machine
    if plan.hosts == 1:
        return f"this machine{m.note}"
    return f"each host{m.note}" if m.note else f"each host like this machine (one of the {plan.hosts})"


def _disk(cfg: Config, hosts: int) -> list[str]:
    """The checkpoints' disk against the output directory's free space (a warning; the verdict is memory's):
    each host writes its slice of the three fp32 planes as its part of each checkpoint, every part into the one
    checkpoint directory (a filesystem every node sees), so a checkpoint counts every part; the final fp32
    weights counted whole."""
    from megatrain.launch.config.diskplan import disk_lines, disk_need
    from megatrain.launch.prepare.outdir import resolve_output

    layout = arch_of(cfg).layout
    out = resolve_output(cfg.train.output_dir, cfg.train.run_id or "{run_id}")
    part = 4 * host_plane_elems(layout, hosts) * 3
    lines = disk_lines(cfg.train, out, hosts * part, 4 * layout.total)
    if hosts > 1 and disk_need(cfg.train, part)[0]:
        lines.append(f"  each checkpoint: the {hosts} hosts' parts of {human_bytes(part)} each, all in this directory")
    return lines


def report(args: argparse.Namespace) -> int:
    """Print the plan of launch/cli/plan_cmd.py's arguments; 0 when it fits, 1 when it does not."""
    cfg, where = load_tree(args.config, args.overrides)
    validate_plan(cfg, where)  # planning comes before the download: config.json is enough
    gpu_gib, named = args.gpu_gib, ""
    if gpu_gib is None and args.gpu is not None and cfg.engine.device != "cpu":  # a GPU by name: its memory too
        gpu_gib, named = timeplan.named_gpu_gib(args.gpu)
    free, cuda, note = _gpu(cfg, gpu_gib)
    hosts = _hosts(args.hosts, cfg)
    plan = make_plan(cfg, free, cuda, this_host(cfg, args.host_gib), hosts)
    plan = dataclasses.replace(plan, gpu_note=named or note)
    engine, n = resolve_engine(cfg.engine, cuda), executors_of(cfg, cuda)
    asked = timeplan.Asked(args.gpu, args.gpu_tflops, gpu_gib is not None, args.host_gib is not None)
    held = (plan.memory.gpu.gpu_units, plan.memory.gpu.gpu_units_why)
    spares = (plan.memory.spares, plan.memory.spares_why)
    timing = timeplan.plan_lines(cfg, engine, n, asked, hosts, held, spares)
    print(render(plan, cfg, timing + _weights_note(cfg)))
    return 0 if plan.fits() else 1


def _hosts(hosts: int | None, cfg: Config) -> int:
    """--hosts, else actors.num_hosts (its auto: one host, the plan is of one host like this one)."""
    if hosts is None:
        return cfg.actors.num_hosts if isinstance(cfg.actors.num_hosts, int) else 1
    if hosts < 1:
        raise ConfigError(f"--hosts must be an integer >= 1 (the hosts of the run), got {hosts}")
    return hosts


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
    if not local_gpus():
        remote = bool(cfg.launch.address or os.environ.get("RAY_ADDRESS"))
        problem = gpu_budget_without_gpu(cfg, remote, gpus=0)  # as the run refuses it
        if problem:
            raise ConfigError(f"{problem}; --gpu-gib N plans for a GPU with N GiB free elsewhere")
        if gpubudget.budget_bytes(cfg.engine) is not None:  # a GPU of that budget, on the cluster's node
            return None, True, f" (planned for {gpubudget.KEY})"
        if cfg.engine.device == "cuda":
            raise ConfigError(
                "engine.device is cuda but this machine has no GPU: give --gpu-gib N to plan for a GPU with N GiB free"
            )
        return None, False, ""
    import torch  # a GPU is here: its free memory is read through CUDA

    free, _ = torch.cuda.mem_get_info()
    return free, True, " (a run measures it again in its executor, after its CUDA context)"
