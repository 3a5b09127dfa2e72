"""The actors section of the config, and what the run's roster (megatrain/roster.py) asks of the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config.base import opt
from megatrain.errors import ConfigError
from megatrain.ipc.cpus import ThreadRequest
from megatrain.ipc.shared.shm import host_run_id
from megatrain.roster import Roster, build_roster


@dataclass
class ActorsConfig:
    num_gpus: int | str = opt(
        1,
        "GPU executors sharing the one host store, one GPU each (on the CPU device: executor processes): "
        "each runs its share of every batch (data.batch_size is the whole batch, split by rows), their "
        "gradients are summed on the GPUs, and one Adam updates the store. auto: the GPUs of the node.",
    )
    num_hosts: int | str = opt(
        1,
        "Hosts (nodes of the Ray cluster) the run spans, each with its own store, Adam updater and "
        "actors.num_gpus executors: host h holds slice h of the fp32 master weights and Adam moments (12/H bytes "
        "per parameter) and the whole compute-dtype copy its executors stream from (ipc.staging resident); each "
        "gradient is summed over every executor and split among the hosts, each host updates its slice, and the "
        "updated slices are gathered into every host's copy. data.batch_size is the whole batch, split by rows over "
        "every executor of every host. auto: every node of the Ray cluster alive (one without a cluster).",
    )
    num_packers: int = opt(1, "Pinned-packing worker processes (fp32 master -> compute-dtype slabs).")
    num_accumulators: int = opt(1, "Gradient-accumulation worker processes (gradient slabs -> fp32 plane).")
    # Thread counts: 0 = the node's CPU plan (ipc/cpus.py; printed at start), which splits the
    # cores of the store's node by which roles run at the same time.
    packer_threads: int = opt(
        0, "Torch threads per packing worker (the cast); 0 = half the node's cores, split between the packers."
    )
    accumulator_threads: int = opt(
        0,
        "Numba threads per accumulation worker (copy + norm of each gradient); "
        "0 = the node's cores, split between the accumulators.",
    )
    adam_threads: int = opt(
        0, "Numba and torch threads of the Adam updater (update, resident cast); 0 = all cores of the node."
    )
    executor_threads: int = opt(
        0,
        "Torch intra-op threads of the executor; 0 = 2 on CUDA (it launches and "
        "copies), all cores on the CPU device (it computes).",
    )
    writer_threads: int = opt(
        4,
        "Threads of the checkpoint writer: each checksums and writes 64 MiB chunks, so "
        "several keep a fast disk's queue full while training goes on.",
    )

    def __post_init__(self) -> None:
        if self.num_gpus != "auto" and (isinstance(self.num_gpus, str) or self.num_gpus < 1):
            raise ValueError(f"actors.num_gpus must be auto or >= 1, not {self.num_gpus!r}")
        if self.num_hosts != "auto" and (isinstance(self.num_hosts, str) or self.num_hosts < 1):
            raise ValueError(f"actors.num_hosts must be auto or >= 1, not {self.num_hosts!r}")
        if self.num_packers < 1 or self.num_accumulators < 1:
            raise ValueError("actors.num_packers and actors.num_accumulators must be >= 1")
        if self.writer_threads < 1:
            raise ValueError("actors.writer_threads must be >= 1")
        if min(self.packer_threads, self.accumulator_threads, self.adam_threads, self.executor_threads) < 0:
            raise ValueError("actors: thread counts must be >= 0 (0 = the node's CPU plan)")


def thread_request(cfg: ActorsConfig) -> ThreadRequest:
    return ThreadRequest(
        executor=cfg.executor_threads,
        adam=cfg.adam_threads,
        packer=cfg.packer_threads,
        accumulator=cfg.accumulator_threads,
    )


@dataclass(frozen=True)
class Demand:
    """Scheduler resources of one actor."""

    cpus: float
    gpus: float


def roster_for(actors: ActorsConfig, *, cuda: bool, clip: bool, writer: bool, staging: str, executors: int) -> Roster:
    """The run's roster (megatrain/roster.py) from the actors section, with the staging mode resolved."""
    return build_roster(
        executors=executors,
        packers=actors.num_packers,
        accumulators=actors.num_accumulators,
        cuda=cuda,
        clip=clip,
        writer=writer,
        staging=staging,
    )


def demands(roster: Roster) -> dict[str, Demand]:
    """Per role started with the run, its scheduler resources (the roster's)."""
    return {r.name: Demand(r.cpus, r.gpus) for r in roster.at_launch}


def local_cpus(actors: ActorsConfig) -> float:
    """The CPUs a private Ray instance is started with at least, before the device is known: a CPU-device run
    of one executor, which runs every kind of worker."""
    most = roster_for(actors, cuda=False, clip=True, writer=False, staging="slabs", executors=1)
    return bundle(demands(most))["CPU"]


def bundle(d: dict[str, Demand]) -> dict[str, float]:
    """One placement-group bundle holding every actor that shares the store: one node by construction."""
    cpus = sum(x.cpus for x in d.values())
    gpus = round(sum(x.gpus for x in d.values()), 4)
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def resolve_executors(cfg: ActorsConfig, cuda: bool, gpus: int) -> int:
    """actors.num_gpus as a number: auto is the GPUs of the store's node (`gpus`), or 1 on the CPU device;
    more than the node has is refused (the executors share one host store: one node). On CUDA with no GPU at all,
    engine.device (which asked for CUDA) is at fault, not actors.num_gpus."""
    if cuda and gpus < 1:
        raise ConfigError(
            "engine.device: cuda, but no CUDA device is visible (no GPU on this machine, or on any node of the Ray "
            "cluster the run joined); engine.device=auto runs on a GPU where there is one and on the CPU otherwise"
        )
    if cfg.num_gpus == "auto":
        return max(gpus, 1) if cuda else 1
    n = int(cfg.num_gpus)
    if cuda and n > gpus:
        raise ConfigError(
            f"actors.num_gpus {n}: the node with the most GPUs has {gpus}; the executors share one host store, "
            "so they run on one node (actors.num_gpus=auto takes them all)"
        )
    return n


def resolve_hosts(cfg: ActorsConfig, nodes: int) -> int:
    """actors.num_hosts as a number: auto is every node the runner has (`nodes`; the in-process runner: 1). More
    hosts than nodes is refused where the actors are placed (each host a node of its own)."""
    return max(nodes, 1) if cfg.num_hosts == "auto" else int(cfg.num_hosts)


def check_hosts_run_id(run_id: str, cfg: ActorsConfig, hosts: int) -> None:
    """Refuse a run id with no room for the name of the last host's store (ipc/shared/shm.py host_run_id: the run
    id with `h<h>` after it), naming train.run_id: checked as soon as the number of hosts is known (for auto, once the
    cluster's nodes are counted), before anything is placed or allocated."""
    if hosts < 2:
        return
    try:
        host_run_id(run_id, hosts - 1)
    except ValueError as exc:
        count = f"{hosts}" if cfg.num_hosts == hosts else f"{cfg.num_hosts}: {hosts} hosts, one per node alive"
        raise ConfigError(f"train.run_id: {exc} (actors.num_hosts {count})") from None


def batch_split_problem(batch: int, executors: int) -> str | None:
    """Why data.batch_size cannot be split by rows over the executors, or None."""
    if executors > batch:
        return f"{batch} is split by rows over actors.num_gpus {executors} executors: it must be at least that"
    return None


def per_executor(batch: int, executors: int) -> int:
    """The most sequences one executor runs per step (the rows split as evenly as they go)."""
    return -(-batch // max(executors, 1))


def describe_need(d: dict[str, Demand]) -> str:
    """What the actors ask of one node, per role, and the settings that lower it (the message of a cluster
    too small for the run, and `megatrain-launch plan`)."""
    b = bundle(d)
    roles = ", ".join(f"{r} {x.cpus:g}" + (f" + {x.gpus:g} GPU" if x.gpus else "") for r, x in d.items())
    cpus = f"{b['CPU']:g} CPUs" + (f" and {b['GPU']:g} GPU" if b.get("GPU") else "")
    return (
        f"{cpus} on one node ({roles}); fewer CPUs: actors.num_packers and actors.num_accumulators (at least 1 "
        "each, one CPU each), optim.max_grad_norm=0 (no accumulators); the thread counts do not change it"
    )


def resources_text(have: dict[str, float]) -> str:
    """CPUs and GPUs as a message says them: '4 CPUs and 1 GPU'."""
    cpus, gpus = have.get("CPU", 0), have.get("GPU", 0)
    return f"{cpus:g} CPU{'s' * (cpus != 1)}" + (f" and {gpus:g} GPU{'s' * (gpus != 1)}" if gpus else "")


def placement_wait(bundle: dict[str, float], hosts: int, timeout: float, nodes: list[dict], free: dict) -> str:
    """The line a run prints while its placement waits for the cluster: what each host needs of a node of its own,
    for how long it waits (launch.placement_timeout_s), and what the cluster has: each node alive, in all, and
    what is free now."""
    need = resources_text(bundle)
    who = (
        f"the run's actors: one node with {need} free"
        if hosts == 1
        else f"hosts 0-{hosts - 1}: each a node of its own with {need} free"
    )
    sizes = "; ".join(resources_text(n) for n in nodes) or "none"
    count = f"{len(nodes)} node{'s' * (len(nodes) != 1)} alive"
    return (
        f"waiting up to {timeout:g} s (launch.placement_timeout_s) for the placement of {who}; the cluster has "
        f"{count} ({sizes}), {resources_text(free)} free now"
    )
