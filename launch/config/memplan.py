"""The run's memory plan (megatrain/memory/) from the config tree, as the run makes it and `megatrain-launch
plan` renders it (launch/cli/plan_view.py).

The plan is the one a run makes (megatrain/memory/plan.py plan_memory): the host part against this machine
(RAM available, /dev/shm free, Ray's memory monitor) or the host `--host-gib` names, the GPU part against the
GPU's free memory or `--gpu-gib`, with a verdict and the settings that need less. The run itself refuses a
plan that does not fit before it allocates anything: the store owner re-checks the host part on its node
(ipc/shared/shm.py check_space), the auto sizes the GPU part. With `--hosts H` the plan is that of one host of a run
over H hosts alike (megatrain/memory/hosts.py), actors.num_hosts's by default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatrain.config.engine import resolve_engine
from megatrain.errors import ConfigError
from megatrain.flops import active_params, expert_params
from megatrain.ipc.protocol.ctl import CTL_FIXED, PIECE_BYTES
from megatrain.ipc.shared.shm import HEADER_BYTES
from megatrain.launch.config.tree import Config
from megatrain.launch.control.placement import demands, describe_need, per_executor, resolve_executors
from megatrain.memory.machine import (
    GIB,
    Machine,
    local_gpus,
    machine_of,
    run_threshold,
    this_machine,
)
from megatrain.memory.plan import CHECKPOINT_HEADROOM_FRACTION, MemoryPlan, RunShape, plan_memory
from megatrain.model.arch import Arch, arch_from_config, arch_of_spec

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

Host = Machine  # the machine a plan is made for
__all__ = ["CHECKPOINT_HEADROOM_FRACTION", "GIB", "Host", "MemPlan", "make_plan", "this_host"]


@dataclass(frozen=True, kw_only=True)
class MemPlan:
    """A memory plan as `megatrain-launch plan` shows it: the plan, and what the rendering says of the model."""

    memory: MemoryPlan
    title: str
    num_params: int = 0
    active_params: int = 0  # what a token computes with (megatrain/flops.py); num_params for a dense model
    expert_params: int = 0  # the routed experts' tensors, all of them; 0 for a dense model
    need: str = ""  # what the actors ask of one node (launch/control/placement.py)
    gpu_note: str = ""

    @property
    def machine(self) -> Machine:
        return self.memory.machine

    @property
    def host(self) -> dict[str, int]:
        return self.memory.host

    @property
    def gpu(self) -> dict[str, int]:
        return self.memory.gpu.terms

    @property
    def cuda(self) -> bool:
        return self.memory.shape.cuda

    @property
    def hosts(self) -> int:
        return self.memory.shape.hosts

    @property
    def gpu_free(self) -> int | None:
        return self.memory.gpu.free

    @property
    def gpu_budget(self) -> int | None:
        return self.memory.gpu.budget

    @property
    def gpu_error(self) -> str:
        return self.memory.gpu.error

    @property
    def sizes(self) -> str:
        part = self.memory.gpu
        return str(part.sizes) + (f" ({part.why})" if part.why else "")

    def run_pss(self) -> int:
        return self.memory.run_pss()

    def host_fits(self) -> bool:
        return self.memory.host_fits()

    def gpu_fits(self) -> bool:
        return self.memory.gpu_fits()

    def fits(self) -> bool:
        return self.memory.fits()


def ray_threshold(cfg: Config) -> float | None:
    """The memory-monitor threshold the run's Ray would have (megatrain/memory/machine.py run_threshold)."""
    return run_threshold(cfg.launch.runner == "inprocess", _joins_cluster(cfg))


def _joins_cluster(cfg: Config) -> bool:
    return bool(cfg.launch.address or os.environ.get("RAY_ADDRESS"))


def this_host(cfg: Config, host_gib: float | None = None) -> Machine:
    """This machine (or, with `host_gib`, one with that much RAM, all of it free and /dev/shm as large), with
    the memory-monitor threshold the run's Ray would have."""
    if host_gib is None:
        return this_machine(cfg.ipc.shm_dir, ray_threshold(cfg))
    if host_gib <= 0:
        raise ConfigError("--host-gib must be > 0")
    return machine_of(host_gib, ray_threshold(cfg))


def executors_of(cfg: Config, cuda: bool) -> int:
    """actors.num_gpus for the plan, as given (the plan may be for another machine); auto is this machine's
    GPUs, and a planned GPU (--gpu-gib) without one here counts as one."""
    if cfg.actors.num_gpus != "auto":
        return int(cfg.actors.num_gpus)
    return resolve_executors(cfg.actors, cuda, max(local_gpus(), 1) if cuda else 0)


def run_shape(cfg: Config, cuda: bool, executors: int | None = None, hosts: int = 1) -> RunShape:
    """What of `cfg` the memory plan reads, on a machine with (`cuda`) or without a GPU, one of `hosts`."""
    n = executors_of(cfg, cuda) if executors is None else executors
    return RunShape(
        engine=resolve_engine(cfg.engine, cuda),
        executors=n,
        batch=per_executor(cfg.data.batch_size, n * hosts),  # each executor's GPU holds its share of the batch
        seq=cfg.data.seq_len,
        clip=cfg.optim.clips,
        staging=cfg.ipc.staging,
        weight_slabs=cfg.ipc.weight_slabs,
        grad_slabs=cfg.ipc.grad_slabs,
        slab_params=cfg.ipc.slab_params,
        num_packers=cfg.actors.num_packers,
        num_accumulators=cfg.actors.num_accumulators,
        saves_checkpoints=cfg.train.saves_checkpoints,
        launcher=cfg.launch.runner != "inprocess",
        private_ray=not _joins_cluster(cfg),
        header_bytes=HEADER_BYTES,
        ctl_fixed=CTL_FIXED,
        ctl_piece_bytes=PIECE_BYTES,
        hosts=hosts,
        spare_slots=cfg.ipc.spare_slots,
    )


def run_plan(cfg: Config, spec: ModelSpec, cuda: bool, executors: int, machine: Machine, hosts: int = 1) -> MemoryPlan:
    """A run's memory plan (each host's, of `hosts`), made once by its driver before the store: the GPU's free
    memory is measured later, in the executor, which sizes the engine within the plan's room for pinned
    checkpoints."""
    return plan_memory(arch_of_spec(spec), run_shape(cfg, cuda, executors, hosts), machine)


def host_room(cfg: Config, arch: Arch, cuda: bool, machine: Machine, hosts: int = 1) -> int | None:
    """Host RAM left on `machine`, one of `hosts`, for the executors' pinned activation checkpoints (None off
    CUDA)."""
    return plan_memory(arch, run_shape(cfg, cuda, hosts=hosts), machine).pinned_room


def arch_of(cfg: Config) -> Arch:
    """The model of the config, read without torch (model.pretrained's config.json where set)."""
    return arch_from_config(cfg.model, no_decay_1d=cfg.optim.no_decay_1d)


def make_plan(cfg: Config, gpu_free: int | None, cuda: bool, machine: Machine | None = None, hosts: int = 1) -> MemPlan:
    """The plan of `cfg` on `machine` (default: this host), each of `hosts` hosts like it."""
    arch = arch_of(cfg)
    shape = run_shape(cfg, cuda, hosts=hosts)
    plan = plan_memory(arch, shape, machine or this_host(cfg), gpu_free)
    n, d, engine = shape.executors, cfg.data, plan.engine
    active, experts = active_params(arch), expert_params(arch)
    title = (
        f"{_params(arch, active, experts)}, "
        f"{d.batch_size}x{d.seq_len} tokens per step"
        + (f" over {n} executors (at most {shape.batch} sequences each)" if n > 1 else "")
        + f", engine on {engine.device} ({engine.compute_dtype}), "
        f"staging {plan.staging_mode}, clipping {'on' if shape.clip else 'off'}"
    )
    return MemPlan(
        memory=plan,
        title=title,
        num_params=arch.layout.num_params,
        active_params=active,
        expert_params=experts,
        need=describe_need(demands(plan.roster)),
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _params(arch: Arch, active: int, experts: int) -> str:
    """The title's model part: family, layers, parameters; of a mixture of experts also the active
    parameters per token and the routed experts' (`active`, `experts`: flops.py's counts)."""
    head = f"{arch.family}, {arch.layout.num_layers} layers"
    if not arch.is_moe:
        return f"{head}, {arch.layout.num_params / 1e6:.2f}M params"
    shared = ", plus a shared expert" if arch.shared_expert_intermediate_size else ""
    return (
        f"{head}, {_count(arch.layout.num_params)} params ({_count(active)} active per token; "
        f"experts {_count(experts)}: {arch.num_experts} per layer, top-{arch.experts_per_token}{shared})"
    )
