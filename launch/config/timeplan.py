"""How long a run would take, for `megatrain-launch plan` and for a line at the start of a run: a step's time
and the whole run's on the machine planned for (megatrain/steptime.py), said as an estimate with how it was
made. A run estimated at more than a day is warned of; the plan's verdict stays memory's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatrain import steptime
from megatrain.config.engine import EngineConfig
from megatrain.errors import ConfigError
from megatrain.flops import active_params, model_step_flops
from megatrain.ipc.cpus import node_cores
from megatrain.launch.config.tree import Config
from megatrain.launch.control.placement import per_executor
from megatrain.memory.gpu import gpu_params
from megatrain.memory.host import spare_order
from megatrain.memory.hosts import network_bytes
from megatrain.memory.machine import local_gpus
from megatrain.model.arch import Arch, arch_from_config, arch_of_spec

if TYPE_CHECKING:  # the crew imports the actors, which a plan does not need; the spec, torch
    from megatrain.launch.control.crew import Crew
    from megatrain.model.spec import ModelSpec

DAY_S = 86400.0


@dataclass(frozen=True)
class Basis:
    """What a time estimate assumes: the device's rate (None: no estimate, `why` says so) and the host's
    memory bandwidth for the Adam pass."""

    rate: steptime.Rate | None
    host_bytes_per_s: float = steptime.BENCH_HOST_BYTES_PER_S
    host_how: str = ""
    why: str = ""


def executor_threads(cfg: Config, executors: int) -> int:
    """The torch threads of a CPU-device executor (ipc/cpus.py's rule, or actors.executor_threads)."""
    return cfg.actors.executor_threads or max(1, node_cores() // max(executors, 1))


def mlp_shape(cfg: Config, arch: Arch, executors: int, hosts: int = 1) -> tuple[int, int, int]:
    """(hidden, intermediate, tokens of an executor's batch, the batch split over `executors` on each of
    `hosts`): the matmul a CPU's rate is timed on (HF's intermediate_size, which is an expert's width in the
    families with no dense MLP)."""
    inner = arch.fields.get("intermediate_size") or 4 * arch.hidden_size
    return arch.hidden_size, inner, per_executor(cfg.data.batch_size, executors * hosts) * cfg.data.seq_len


def cpu_rate(cfg: Config, arch: Arch, engine: EngineConfig, executors: int, hosts: int = 1) -> steptime.Rate:
    """This CPU's rate for the model, measured with the threads the executor would run (with torch, as the
    executor computes: only a plan for this machine's CPU imports it)."""
    import torch

    dtype = torch.bfloat16 if engine.compute_dtype == "bf16" else torch.float32
    return steptime.cpu_rate(*mlp_shape(cfg, arch, executors, hosts), dtype, executor_threads(cfg, executors))


@dataclass(frozen=True)
class Asked:
    """What the plan's command line says of the machine the time is for: --gpu NAME, --gpu-tflops N, and
    whether --gpu-gib and --host-gib plan for another machine than this one."""

    gpu: str | None = None
    tflops: float | None = None
    gpu_gib: bool = False
    host_gib: bool = False


def asked_gpu_rate(asked: Asked) -> steptime.Rate:
    """--gpu NAME (a GPU the table knows) or --gpu-tflops N (its nominal dense bf16 rate)."""
    if asked.tflops is not None:
        if asked.tflops <= 0:
            raise ConfigError(f"--gpu-tflops {asked.tflops:g}: a GPU's TFLOPS must be > 0")
        eff = steptime.GPU_EFFICIENCY
        return steptime.Rate(
            asked.tflops * 1e12 * eff,
            f"--gpu-tflops {asked.tflops:g} (nominal dense bf16) x {eff:.0%}, MegaTrain's share of it in BENCHMARKS.md",
        )
    rate = steptime.gpu_rate(asked.gpu or "")
    if rate is None:
        known = ", ".join(label for label, _, _ in steptime.GPUS)
        raise ConfigError(
            f"--gpu '{asked.gpu}': not a GPU the plan knows ({known}); give its nominal dense bf16 rate with "
            "--gpu-tflops N instead"
        )
    return rate


def named_gpu_gib(gpu: str) -> tuple[float, str]:
    """`plan --gpu NAME` without --gpu-gib: (GiB free, the plan's note of it) on a GPU of that name, its data
    sheet's memory as CUDA reports it less the CUDA context. A ConfigError where the name does not say
    which of its sizes, or the plan does not know it."""
    from megatrain.memory.budget import CONTEXT_BYTES, GIB

    sizes = steptime.gpu_memory_gb(gpu)
    if not sizes:
        asked_gpu_rate(Asked(gpu=gpu))  # not a GPU the plan knows: its error
    if len(sizes) > 1:
        said = " or ".join(f"'{gpu} {gb}GB'" for gb in sizes)
        raise ConfigError(
            f"--gpu '{gpu}' comes with {' or '.join(map(str, sizes))} GB: name it as {said}, or add --gpu-gib N"
        )
    free = sizes[0] * steptime.REPORTED_GIB_PER_GB - CONTEXT_BYTES / GIB
    return free, f" (--gpu {gpu}: {sizes[0]} GB, {free:.1f} GiB free after the CUDA context; --gpu-gib N for another)"


def gpu_rate(engine: EngineConfig, asked: Asked) -> tuple[steptime.Rate | None, str]:
    """The GPU's rate for a plan: --gpu's or --gpu-tflops', else this machine's GPU's; (None, why) where none
    is known."""
    if engine.compute_dtype != "bf16":
        return None, f"the GPU rates are bf16's, and engine.compute_dtype is {engine.compute_dtype}"
    if asked.gpu is not None or asked.tflops is not None:
        return asked_gpu_rate(asked), ""
    if not local_gpus():
        return None, (
            "the plan knows the GPU's memory, not its speed: name it with --gpu NAME (H100, A100, RTX 4090, ...) "
            "or give its nominal dense bf16 rate with --gpu-tflops N"
        )
    import torch  # a GPU is here: its name and rate are read through CUDA

    rate = steptime.device_gpu_rate(0)
    if rate is None:
        return None, f"{torch.cuda.get_device_name(0)} has no known bf16 rate: --gpu-tflops N gives it"
    if asked.gpu_gib:  # another GPU's memory, without its name: the time is this machine's GPU's, said so
        rate = steptime.Rate(rate.flops_per_s, f"{rate.how} (this machine's GPU; --gpu NAME for another)")
    return rate, ""


def plan_basis(cfg: Config, arch: Arch, engine: EngineConfig, executors: int, asked: Asked, hosts: int = 1) -> Basis:
    """What the plan's time assumes: the planned device (this CPU measured, a GPU by --gpu or this machine's),
    and this host's measured memory bandwidth, or, planning a GPU for a host of --host-gib, the bandwidth
    of BENCHMARKS.md's GPU hosts."""
    cuda = engine.device == "cuda"
    if (asked.gpu is not None or asked.tflops is not None) and not cuda:
        way = "engine.device is cpu" if cfg.engine.device == "cpu" else "add --gpu-gib N, or name the GPU with --gpu"
        raise ConfigError(
            f"--gpu and --gpu-tflops name the GPU the time assumes, but the plan is for the CPU device: {way}"
        )
    rate, why = gpu_rate(engine, asked) if cuda else (cpu_rate(cfg, arch, engine, executors, hosts), "")
    if cuda and asked.host_gib:
        bench = steptime.BENCH_HOST_BYTES_PER_S
        return Basis(rate, bench, f"{bench / 1e9:.0f} GB/s, BENCHMARKS.md's 16-core GPU hosts (--host-gib)", why)
    threads = cfg.actors.adam_threads or node_cores()
    bandwidth = steptime.memory_bytes_per_s(threads)
    how = f"{bandwidth / 1e9:.0f} GB/s, this host's memory bandwidth (a copy timed with {threads} threads)"
    return Basis(rate, bandwidth, how, why)


def evaluation_flops(cfg: Config, arch: Arch, steps: int) -> float | None:
    """The evaluations' FLOPs over the run (a forward: a third of a step's per batch); 0 without evaluation
    data, None where their size is the held-out set's, which the plan does not read."""
    d, t = cfg.data, cfg.train
    if not (d.kind == "arithmetic" or d.eval_path or d.eval_fraction > 0):
        return 0.0
    at = {s for s in range(t.eval_every, steps + 1, t.eval_every)} if t.eval_every else set()
    count = len(at | ({steps} if t.final_eval else set()))
    batches = t.eval_batches or (8 if d.kind == "arithmetic" else 0)
    if count and not batches:
        return None
    return count * batches * model_step_flops(arch, d.batch_size, d.seq_len) / 3


def estimate(
    cfg: Config, arch: Arch, basis: Basis, executors: int, steps: int, hosts: int = 1, gpu_units: int = 0
) -> steptime.Estimate | None:
    """`steps` steps (and the evaluations among them) of the run on `basis`'s machine, `executors` on each of
    `hosts` (the batch split over all of them; each host's Adam over its slice, less the first `gpu_units`
    units, whose update the GPU makes); None without a rate."""
    if basis.rate is None:
        return None
    rate = basis.rate
    if arch.is_moe:  # routing, the experts' smaller matmuls (BENCHMARKS.md)
        rate = steptime.Rate(rate.flops_per_s * steptime.MOE_FACTOR, rate.how, rate.cpu)
    flops = model_step_flops(arch, cfg.data.batch_size, cfg.data.seq_len) / (executors * hosts)
    evals = evaluation_flops(cfg, arch, steps)
    return steptime.step_estimate(
        flops,
        -(-(arch.layout.num_params - gpu_params(arch.layout, gpu_units)) // hosts),
        len(arch.layout.units),
        rate,
        basis.host_bytes_per_s,
        steps,
        None if evals is None else evals / executors,
    )


def plan_lines(
    cfg: Config,
    engine: EngineConfig,
    executors: int,
    asked: Asked,
    hosts: int = 1,
    gpu: tuple[int, str] = (0, ""),
    spares: tuple[int, str] = (0, ""),
) -> list[str]:
    """The plan's time section for the machine planned for, `executors` on each of `hosts` like it; `gpu`: the
    units whose optimizer the GPU holds, and why; `spares`: the units with a spare slot, and why (the memory
    plan's choices)."""
    arch = arch_from_config(cfg.model, no_decay_1d=cfg.optim.no_decay_1d)
    return lines(cfg, arch, plan_basis(cfg, arch, engine, executors, asked, hosts), executors, hosts, gpu, spares)


def lines(
    cfg: Config,
    arch: Arch,
    basis: Basis,
    executors: int,
    hosts: int = 1,
    gpu: tuple[int, str] = (0, ""),
    spares: tuple[int, str] = (0, ""),
) -> list[str]:
    """The plan's time section."""
    d, steps = cfg.data, cfg.train.steps
    est = estimate(cfg, arch, basis, executors, steps, hosts, gpu[0])
    if est is None or basis.rate is None:
        return [f"time: no estimate: {basis.why}"]
    head = f"time (an estimate): {steptime.duration(est.step_s)} a step; train.steps {steps:,}: "
    head += steptime.duration(steps * est.step_s)
    if est.eval_s is None:
        head += ", evaluation not counted (train.eval_batches 0: the whole held-out set, which the plan does not read)"
    elif est.eval_s:
        head += f", evaluation {steptime.duration(est.eval_s)} more"
    if d.epochs:
        head += f" (data.epochs {d.epochs} sets the steps from the data's size instead)"
    moe = f"; x {steptime.MOE_FACTOR} for a mixture of experts" if arch.is_moe else ""
    out = [
        head,
        f"  compute: {model_step_flops(arch, d.batch_size, d.seq_len):.3g} useful FLOPs a step (6·N·D + 12·L·H·S·D, "
        f"N = {active_params(arch) / 1e6:,.1f}M active parameters) in {steptime.duration(est.compute_s)}"
        + _on_each(executors, hosts),
        f"    at {basis.rate.how}{moe}",
        f"  the CPU Adam pass: {steptime.ADAM_BYTES_PER_PARAM} bytes per parameter"
        + (f" of each host's slice (1/{hosts})" if hosts > 1 else "")
        + f" at {basis.host_how}: {steptime.duration(est.adam_s)} a step"
        + (", beside the compute on the same cores" if basis.rate.cpu else ", a floor once the backward ends"),
        *_held(cfg, arch, basis, executors, hosts, gpu, est),
        *_speculated(arch, basis, spares, est),
        *_network(arch, hosts, not basis.rate.cpu, est.step_s),
    ]
    if est.total_s > DAY_S:
        out.append(f"  WARNING: {long_run(est)}")
    return out


def _held(
    cfg: Config, arch: Arch, basis: Basis, executors: int, hosts: int, gpu: tuple[int, str], est: steptime.Estimate
) -> list[str]:
    """The line of engine.gpu_optimizer: the units held, why, and the step without them."""
    units, why = gpu
    if basis.rate is None or basis.rate.cpu:
        return []
    head = f"  the optimizer on the GPU (engine.gpu_optimizer): {why or f'{units} units'}"
    if not units:
        return [head]
    without = estimate(cfg, arch, basis, executors, cfg.train.steps, hosts, 0)
    held, other = gpu_params(arch.layout, units), steptime.duration(without.step_s) if without else "?"
    return [
        head,
        f"    the host's Adam pass leaves out their {held / 1e6:,.1f}M parameters: "
        f"{steptime.duration(est.step_s)} a step against {other} with every update on the host",
        # the planes' pages of the held state are given back once the GPU has it (actors/executor/gpustate.py)
        f"    their fp32 state ({held * 12 / hosts / 2**30:.1f} GiB{' a host' if hosts > 1 else ''}) leaves the "
        "host's planes once the GPU has it: the host holds it at start-up and while a checkpoint's writer or the "
        "final export reads it",
    ]


def _speculated(arch: Arch, basis: Basis, spares: tuple[int, str], est: steptime.Estimate) -> list[str]:
    """The line of ipc.spare_slots: the units with a slot, why, their share of the host's Adam pass, and the step
    that does not clip with them: their update runs during the backward (as much of it as the backward's time
    holds at the host's bandwidth), no longer after it."""
    units, why = spares
    if basis.rate is None or basis.rate.cpu or not why:
        return []
    head = f"  speculative updates (ipc.spare_slots): {why}"
    if not units:
        return [head]
    params = sum(arch.layout.structure_of(u).numel for u in spare_order(arch.layout)[:units])
    share = params / max(arch.layout.num_params, 1)
    backward = steptime.BACKWARD_SHARE * est.compute_s
    early = min(est.adam_s * share, backward)
    step = max(est.compute_s, backward + est.adam_s - early)
    return [
        head,
        f"    {params / 1e6:,.1f}M parameters ({share:.0%} of the host's Adam pass) updated during the backward: "
        f"{steptime.duration(step)} a step that does not clip, {steptime.duration(est.step_s)} one that does",
    ]


def _on_each(executors: int, hosts: int) -> str:
    """Where the compute line's time is spent: each executor's share of the batch."""
    if hosts > 1:
        return f" on each of {executors * hosts} executors ({executors} on each of {hosts} hosts)"
    return f" on each of {executors} executors" if executors > 1 else ""


def _network(arch: Arch, hosts: int, cuda: bool, step_s: float) -> list[str]:
    """Over several hosts: what each host sends a step, and the network speed at which it hides behind the
    estimated step (the gradients' reduce-scatter and the weights' gather overlap the compute, docs/hosts.md)."""
    sent = network_bytes(arch.layout, hosts, cuda)
    if not sent:
        return []
    grads = "the fp32 gradients' reduce-scatter" if cuda else "the fp32 gradients' all-reduce (CPU device)"
    per_s = sent / step_s
    return [
        f"  between the hosts: each sends {sent / 1e9:,.1f} GB a step and receives as much ({grads}, the bf16 "
        f"weights' gather); it hides behind the step at {per_s / 1e9:,.1f} GB/s ({per_s * 8 / 1e9:,.0f} Gb/s) "
        "each way or more"
    ]


def long_run(est: steptime.Estimate) -> str:
    """The words of the warning for a run estimated at more than a day."""
    return (
        f"the whole run ({est.steps:,} steps at {steptime.duration(est.step_s)}) would take about "
        f"{steptime.duration(est.total_s)}, more than a day: a smaller model, batch or train.steps, or a faster device"
    )


def warn_if_long(crew: Crew, cfg: Config, spec: ModelSpec, executors: int, steps: int, hosts: int = 1) -> None:
    """At a run's start: a warning line when its `steps` left are estimated at more than a day, on the rate
    the executor finds for its device and the bandwidth the Adam updater measures on the store's node
    (`executors` on each of `hosts`)."""
    from megatrain import log
    from megatrain.actors.adam_updater import AdamUpdater
    from megatrain.actors.executor.gpu_executor import GpuExecutor
    from megatrain.roster import ADAM, EXECUTOR

    arch = arch_of_spec(spec)
    hidden, inner, tokens = mlp_shape(cfg, arch, executors, hosts)
    rate = crew.call_one(EXECUTOR, GpuExecutor.step_rate, hidden=hidden, inner=inner, tokens=tokens)
    bandwidth = crew.call_one(ADAM, AdamUpdater.memory_bandwidth)
    est = estimate(cfg, arch, Basis(rate, bandwidth), executors, steps, hosts)
    if est is not None and rate is not None and est.total_s > DAY_S:
        flops = model_step_flops(arch, cfg.data.batch_size, cfg.data.seq_len)
        log(
            f"warning: {long_run(est)} (an estimate from {flops:.3g} FLOPs a step at {rate.how}; the CPU Adam "
            f"pass at {bandwidth / 1e9:.0f} GB/s; `megatrain-launch plan` shows it)"
        )
