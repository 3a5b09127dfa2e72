"""The roster: which actors a run has, how many, what each asks of the scheduler, the rule of its threads, what
it attaches to the store with and what it is called with every step, as data built once per run
(build_roster) from the config and the resolved staging mode. Everything else iterates it: placement (the
resources), start-up (spawn, attach, the CUDA IPC events), the step loop and evaluation (the per-step calls),
the node's CPU plan (cpus.py), the pid slots of the control segment (StoreSpec.roles), the memory plan's
processes. The staging mode decides whether packers and accumulators run, so it is resolved before any
worker is spawned: the roster holds exactly the actors the run uses, and none is spawned to be ended again.

Role names: the store owner `store-owner`; executor 0 `gpu-executor`, executor r of several
`gpu-executor-r`; `adam-updater`; `packer-i`; `grad-accumulator-i`; `checkpoint-writer`. role_name() makes
them and parse_role() reads them back; no other module spells one.

Adding a role: a Kind, its Row in ROWS (Ray CPUs, thread rule, attach, per-step verb), its count in
build_roster (and its GPU share in _gpus if it needs the GPU), its thread rule in cpus.py if it is a new
one; then an actor file (a Role subclass in actors/) and its class and constructor arguments in
launch/run/startup.py (ACTORS). Its pid slot, placement, spawn, attach and per-step call follow from
the row. Torch-free: the config tree and `megatrain-launch plan` import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """A kind of actor; its value is the role name (for several of a kind, the name's stem)."""

    OWNER = "store-owner"
    EXECUTOR = "gpu-executor"
    ADAM = "adam-updater"
    PACKER = "packer"
    ACCUMULATOR = "grad-accumulator"
    WRITER = "checkpoint-writer"


HOST_MARK = "@host"  # host h > 0 of a run over several hosts: its actors are `<role>@host<h>` (on_host)
SINGLE = (Kind.OWNER, Kind.ADAM, Kind.WRITER)  # one per run: the kind's value is the name
ORDER = (Kind.OWNER, Kind.EXECUTOR, Kind.ADAM, Kind.PACKER, Kind.ACCUMULATOR, Kind.WRITER)  # of a roster, of pid slots
STAGING_MODES = ("slabs", "resident")
# On CUDA the processes that drain gradient slabs ask for this much of the GPU: Ray hides the GPUs from an actor
# that asks for none, and they must open the executor's IPC events on its device.
GPU_SLIVER = 0.01


class ThreadRule(Enum):
    """How a role's torch and Numba threads follow from the cores of the store's node (cpus.py evaluates it)."""

    ALL = "all cores, torch and Numba"
    UPDATER = "all cores, torch and Numba, or actors.adam_threads"
    EXECUTOR = "2 torch threads on CUDA (it launches and copies); the cores split between the executors on the CPU"
    PACKER = "half the cores split between the packers (torch: the cast), 1 Numba"
    ACCUMULATOR = "the cores split between the accumulators (Numba: copy and norm), 1 torch"
    ONE = "1 and 1 (its I/O threads are its own)"


class Attach(Enum):
    """What a role attaches to the made store with."""

    NONE = "it makes the store"
    SPEC = "the store's spec"
    ENGINE = "the spec and the engine's chosen sizes"
    START = "the spec and the first step (Adam's bias correction continues)"


class Verb(Enum):
    """What a role is called with every training step."""

    NONE = "no call per step"
    ROWS = "step(t, its rows of the batch)"
    UPDATE = "step(t, lr, saving)"
    STREAM = "step(t): its share of the slabs (weights packed, or gradients drained)"


@dataclass(frozen=True, kw_only=True)
class Row:
    """What every role of a kind shares."""

    cpus: float  # Ray CPUs
    threads: ThreadRule
    attach: Attach
    verb: Verb


ROWS: dict[Kind, Row] = {
    # It works before the steps (make, fill) and in its monitor thread: it asks for no CPU.
    Kind.OWNER: Row(cpus=0.0, threads=ThreadRule.ALL, attach=Attach.NONE, verb=Verb.NONE),
    Kind.EXECUTOR: Row(cpus=1.0, threads=ThreadRule.EXECUTOR, attach=Attach.ENGINE, verb=Verb.ROWS),
    Kind.ADAM: Row(cpus=1.0, threads=ThreadRule.UPDATER, attach=Attach.START, verb=Verb.UPDATE),
    Kind.PACKER: Row(cpus=1.0, threads=ThreadRule.PACKER, attach=Attach.SPEC, verb=Verb.STREAM),
    Kind.ACCUMULATOR: Row(cpus=1.0, threads=ThreadRule.ACCUMULATOR, attach=Attach.SPEC, verb=Verb.STREAM),
    # Disk-bound (it waits on the disk, not a core): no CPU; called per checkpoint, not per step.
    Kind.WRITER: Row(cpus=0.0, threads=ThreadRule.ONE, attach=Attach.SPEC, verb=Verb.NONE),
}


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """One actor of the run."""

    name: str
    kind: Kind
    index: int  # among its kind: an executor's rank, a packer's or accumulator's number
    cpus: float  # Ray resources
    gpus: float
    threads: ThreadRule
    attach: Attach
    verb: Verb
    drains: bool = False  # drains the executor's gradient slabs: opens its CUDA IPC events
    on_demand: bool = False  # not started with the run: spawned when first needed (a writer at a graceful stop)


@dataclass(frozen=True, kw_only=True)
class Roster:
    """The run's actors, in ORDER; `staging`: the resolved staging mode they were chosen for."""

    roles: tuple[RoleSpec, ...]
    staging: str
    cuda: bool
    clip: bool

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"a roster names each role once, not {names}")

    def __getitem__(self, name: str) -> RoleSpec:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"no role '{name}' in this run (roles: {', '.join(self.names())})")

    def __contains__(self, name: object) -> bool:
        return any(r.name == name for r in self.roles)

    def of(self, *kinds: Kind) -> tuple[RoleSpec, ...]:
        """The roles of these kinds (every role without any), in ORDER."""
        return tuple(r for r in self.roles if not kinds or r.kind in kinds)

    def names(self, *kinds: Kind) -> list[str]:
        return [r.name for r in self.of(*kinds)]

    def count(self, kind: Kind) -> int:
        return len(self.of(kind))

    @property
    def at_launch(self) -> tuple[RoleSpec, ...]:
        """The roles spawned with the run (not on demand)."""
        return tuple(r for r in self.roles if not r.on_demand)

    @property
    def workers(self) -> tuple[RoleSpec, ...]:
        """The roles spawned with the run that attach to the store the owner makes."""
        return tuple(r for r in self.at_launch if r.attach is not Attach.NONE)

    def stepping(self, verb: Verb) -> list[str]:
        """The roles spawned with the run that are called with `verb` every step."""
        return [r.name for r in self.at_launch if r.verb is verb]

    def drainers(self) -> list[str]:
        """The roles that open the executor's CUDA IPC events of the gradient slabs."""
        return [r.name for r in self.at_launch if r.drains]


def role_name(kind: Kind, index: int = 0) -> str:
    """The name of role `index` of `kind`."""
    if index < 0 or (kind in SINGLE and index):
        raise ValueError(f"{kind.value} has no role {index}")
    if kind in SINGLE or (kind is Kind.EXECUTOR and index == 0):
        return kind.value
    return f"{kind.value}-{index}"


def on_host(name: str, host: int) -> str:
    """Role `name` of host `host` of a run over several hosts, as the driver names its actor: host 0's roles
    keep their own names (a run on one host names its actors as it always has); every host's store knows its
    roles by their own names (its pid slots)."""
    if host < 0:
        raise ValueError(f"a run has no host {host}")
    return name if host == 0 else f"{name}{HOST_MARK}{host}"


def split_host(name: str) -> tuple[str, int]:
    """(the role's own name, its host) of a name on_host made."""
    role, mark, host = name.partition(HOST_MARK)
    if mark and not (host.isdigit() and int(host) > 0):
        raise ValueError(f"'{name}' is not an actor: '{HOST_MARK}' must be followed by a host number above 0")
    return role, int(host) if mark else 0


def shown(name: str, hosts: int) -> str:
    """Actor `name` (as on_host names it) in what a run says of it: over several hosts every actor with its host,
    host 0's too (`adam-updater@host0`), so that no message leaves its host to be guessed; on one host its own."""
    role, host = split_host(name)
    return f"{role}{HOST_MARK}{host}" if hosts > 1 else role


def parse_role(name: str) -> tuple[Kind, int]:
    """The kind and index of a role name (of any host); ValueError for a name no run has."""
    name = split_host(name)[0]
    for kind in Kind:
        if name == kind.value and kind in (*SINGLE, Kind.EXECUTOR):
            return kind, 0
        stem, _, number = name.rpartition("-")
        if kind not in SINGLE and stem == kind.value and number.isdigit():
            return kind, int(number)
    raise ValueError(f"'{name}' is not an actor ({', '.join(ROLE_FORMS)})")


def kind_of(name: str) -> Kind:
    return parse_role(name)[0]


ROLE_FORMS = (
    "gpu-executor",
    "gpu-executor-N",
    "adam-updater",
    "store-owner",
    "checkpoint-writer",
    "packer-N",
    "grad-accumulator-N",
)  # the names as a user may write them (messages)
OWNER = role_name(Kind.OWNER)
EXECUTOR = role_name(Kind.EXECUTOR)  # executor 0: it alone records timelines, is profiled, reports the device
ADAM = role_name(Kind.ADAM)
WRITER = role_name(Kind.WRITER)


def slot_names(*, executors: int, packers: int, accumulators: int) -> list[str]:
    """Every worker role a store of these counts may have, in pid-slot order (StoreSpec.roles): the roster's
    order, whichever of them run."""
    counts = {Kind.EXECUTOR: executors, Kind.ADAM: 1, Kind.PACKER: packers, Kind.ACCUMULATOR: accumulators}
    return [role_name(k, i) for k in ORDER if k is not Kind.OWNER for i in range(counts.get(k, 1))]


def slabs_refusal(executors: int, hosts: int) -> str:
    """Why weight staging in slabs cannot serve a run of `executors` executors per host over `hosts` hosts ('' where
    it can): slabs are filled for one reader from the whole fp32 weights, so several executors (every one streams
    every unit) read the resident copy, and so does a run over several hosts, each host's executors from its own
    (no host holds the whole fp32 weights a packer would fill slabs from). The one statement of the rule: the
    config, the staging rule (megatrain/memory/plan.py), the roster and the store's spec refuse with it."""
    copy = "needs the resident copy (ipc.staging: resident or auto)"
    if executors > 1:
        return f"slabs streams weights to one executor; actors.num_gpus {executors} {copy}"
    if hosts > 1:
        return (
            f"slabs are packed from the whole fp32 weights, which no host of actors.num_hosts {hosts} holds: "
            f"actors.num_hosts {hosts} {copy}"
        )
    return ""


def running_workers(*, packers: int, accumulators: int, clip: bool, staging: str) -> dict[Kind, int]:
    """The packers and accumulators that run in staging mode `staging` (resolved), of those configured: packers
    only with slabs (in resident mode Adam writes the copy the DMA reads), accumulators only with slabs and
    clipping (without clipping Adam drains the gradient slabs; in resident mode the gradients wait in the copy)."""
    if staging not in STAGING_MODES:
        raise ValueError(f"the roster takes a resolved staging mode ({' or '.join(STAGING_MODES)}), not '{staging}'")
    slabs = staging == "slabs"
    return {Kind.PACKER: packers if slabs else 0, Kind.ACCUMULATOR: accumulators if slabs and clip else 0}


def build_roster(
    *, executors: int, packers: int, accumulators: int, cuda: bool, clip: bool, writer: bool, staging: str
) -> Roster:
    """The run's actors. `staging`: resolved ('slabs' or 'resident'); the workers that run follow from it
    (running_workers). `writer`: periodic checkpoints are on (else the writer is spawned on demand, at a graceful
    stop)."""
    workers = running_workers(packers=packers, accumulators=accumulators, clip=clip, staging=staging)
    if executors < 1 or packers < 1 or accumulators < 1:
        raise ValueError("a run has at least one executor, packer and accumulator configured")
    refusal = slabs_refusal(executors, 1)
    if refusal and staging != "resident":
        raise ValueError(refusal)
    slabs = staging == "slabs"
    counts = {Kind.EXECUTOR: executors, **workers}
    drainers = counts[Kind.ACCUMULATOR] if clip else 1  # without clipping Adam drains the slabs itself
    roles = tuple(
        RoleSpec(
            name=role_name(kind, i),
            kind=kind,
            index=i,
            cpus=ROWS[kind].cpus,
            gpus=_gpus(kind, i, cuda, clip, drainers),
            threads=ROWS[kind].threads,
            attach=ROWS[kind].attach,
            verb=ROWS[kind].verb,
            drains=kind is Kind.ACCUMULATOR or (kind is Kind.ADAM and not clip and slabs),
            on_demand=kind is Kind.WRITER and not writer,
        )
        for kind in ORDER
        for i in range(counts.get(kind, 1))
    )
    return Roster(roles=roles, staging=staging, cuda=cuda, clip=clip)


def _gpus(kind: Kind, index: int, cuda: bool, clip: bool, drainers: int) -> float:
    """A role's share of a GPU: each executor one GPU, executor 0's less the slivers of the processes that
    drain its gradient slabs (they share its device)."""
    if not cuda:
        return 0.0
    if kind is Kind.EXECUTOR:
        return round(1.0 - GPU_SLIVER * drainers, 4) if index == 0 else 1.0
    if kind is Kind.ACCUMULATOR or (kind is Kind.ADAM and not clip):
        return GPU_SLIVER
    return 0.0
