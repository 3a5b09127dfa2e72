"""The messages that cross a process: what the driver asks of an actor, and what the actor answers.

Every message is a frozen, keyword-only dataclass: it is pickled through Ray (or handed over as is by the
in-process runner), so nothing may change it on the way, and a field added later cannot shift the others.
The executor's answer (StepReport) says for each field how the answers of several executors become one
(`merge`), and in what order its fields become a row of metrics.jsonl (`row`).

Kept free of torch and numba at import: the launcher's light paths (the config tree, `plan`, `status`) may
name these types without loading the training stack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from megatrain.errors import ProtocolError
from megatrain.ipc.cpus import ThreadRequest

if TYPE_CHECKING:
    import torch

    from megatrain.config.engine import EngineConfig
    from megatrain.config.ipc import IpcConfig
    from megatrain.config.model import ModelConfig
    from megatrain.memory.plan import MemoryPlan
    from megatrain.model.spec import ModelSpec

# How several executors' values of one StepReport field become the step's (each executor runs its rows of
# the batch): the sum of their parts, the largest (the step waits for the slowest), or executor 0's (a
# whole-batch statistic every executor holds, or what executor 0 alone records).
SUM, MAX, FIRST = "sum", "max", "first"


def _sum(values: list[Any]) -> Any:
    return None if values[0] is None else sum(values)  # None: no executor counts it


def _max(values: list[Any]) -> Any:
    return None if values[0] is None else max(values)  # None: no executor measures it (the CPU device)


def _first(values: list[Any]) -> Any:
    return values[0]


MERGE: dict[str, Callable[[list[Any]], Any]] = {SUM: _sum, MAX: _max, FIRST: _first}


def _merged(rule: str, default: Any = ...) -> Any:
    """A StepReport field with its merge rule; `default` for the fields an executor may leave out."""
    if default is ...:
        return field(metadata={"merge": rule})
    return field(default=default, metadata={"merge": rule})


@dataclass(frozen=True, kw_only=True)
class ActorInfo:
    """Role.info's answer, who answers for a role: its process, host, and start-up timeline (time.time() per
    stage)."""

    name: str
    pid: int
    host: str
    marks: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class StepRequest:
    """GpuExecutor.step's request: train on rows `ids` / `labels` of step `step`'s batch (the weights after
    step-1's update). `timeline` records the per-unit lanes; `profile` (a path on the executor's node) runs
    the step under torch.profiler; `positions`: the tokens' offsets in their documents, None for one causal
    sequence per row; `lr`: the step's learning rate (for the units whose optimizer the device holds)."""

    step: int
    ids: torch.Tensor
    labels: torch.Tensor
    timeline: bool = False
    profile: str = ""
    positions: torch.Tensor | None = None
    lr: float = 0.0  # the step's learning rate: the executor updates the units its device holds with it


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """GpuExecutor.step's answer. The field order is the order of the executor's part of a metrics.jsonl row
    (launch/report/metrics.py documents each field); a None field is left out of the row."""

    loss: float = _merged(SUM)  # each executor's part is normalized by the whole batch's tokens
    tokens: int = _merged(SUM)
    compute_s: float = _merged(MAX)
    weight_wait_s: float = _merged(MAX)
    grad_wait_s: float = _merged(MAX)
    h2d_bytes: int = _merged(SUM)
    d2h_bytes: int = _merged(SUM)
    forward_s: float = _merged(MAX)
    head_s: float = _merged(MAX)
    backward_s: float = _merged(MAX)
    aux_loss: float | None = _merged(FIRST, None)  # mixture of experts: reduced over the executors already
    expert_load: list[list[int]] | None = _merged(FIRST, None)
    gpu_peak_bytes: int | None = _merged(MAX, None)  # CUDA only
    gpu_units: int | None = _merged(SUM, None)  # engine.gpu_optimizer: the units updated on the devices
    gpu_update_s: float | None = _merged(MAX, None)  # the wait for Adam's norm and that update
    timeline: dict | None = _merged(FIRST, None)  # executor 0's only (train.timeline_step)
    profile: dict | None = _merged(FIRST, None)  # executor 0's only: StepProfile.result, or why it failed
    # Several executors: each one's compute_s, executor 0 first. Made by merge, never by an executor.
    executor_compute_s: tuple[float, ...] | None = None

    @classmethod
    def merge(cls, parts: Sequence[StepReport]) -> StepReport:
        """Several executors' answers as the step's, field by field by its rule; one answer is the step's."""
        if not parts:
            raise ProtocolError("a step answered by no executor")
        if len(parts) == 1:
            return parts[0]
        merged = {
            f.name: MERGE[f.metadata["merge"]]([getattr(p, f.name) for p in parts]) for f in fields(cls) if f.metadata
        }
        return cls(**merged, executor_compute_s=tuple(p.compute_s for p in parts))

    def row(self) -> dict[str, Any]:
        """The executor's part of the step's metrics row: every field that is set, in order, the profile's
        keys in its place; executor_compute_s as a list (as JSON writes it)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "profile":
                out.update(value)
            else:
                out[f.name] = list(value) if f.name == "executor_compute_s" else value
        return out


@dataclass(frozen=True, kw_only=True)
class AdamRequest:
    """AdamUpdater.step's request: apply step `step`'s gradients at learning rate `lr`. `saving`: the checkpoint
    of the state before this update (after `step` steps) is being written; each piece is updated only once
    the writer has it on disk."""

    step: int
    lr: float
    saving: bool = False


@dataclass(frozen=True, kw_only=True)
class Applied:
    """AdamUpdater.step's answer: the global gradient norm, the clip scale, whether the step was skipped
    whole, each piece's (unit, start, end) in time.time() seconds (the timeline's Adam lane), and the
    updater's time for the whole step, waits included."""

    grad_norm: float
    clip_scale: float
    skipped: bool
    unit_spans: tuple[tuple[int, float, float], ...] = ()
    adam_s: float = 0.0
    speculated: int = 0  # units updated speculatively into their spare slots during the backward
    committed: int = 0  # of those, the ones whose slot became their state (the step did not clip)

    @staticmethod
    def merge(parts: list[Applied]) -> Applied:
        """Each host's updater's answer as the step's (a run over several hosts): they agree on the global norm
        and on skipping; host 0's timeline, the slowest host's time."""
        first = parts[0]
        for host, other in enumerate(parts[1:], start=1):
            same = other.skipped == first.skipped and (
                first.skipped or math.isclose(other.grad_norm, first.grad_norm, rel_tol=1e-6)
            )
            if not same:
                raise ProtocolError(
                    f"host {host}'s Adam update disagrees with host 0's: gradient norm {other.grad_norm} against "
                    f"{first.grad_norm}, skipped {other.skipped} against {first.skipped}"
                )
        return dataclasses.replace(first, adam_s=max(p.adam_s for p in parts))


@dataclass(frozen=True, kw_only=True)
class Packed:
    """Packer.step's answer: the pieces it cast into weight slabs."""

    packed: int


@dataclass(frozen=True, kw_only=True)
class Drained:
    """GradAccumulator.step's answer: the gradient pieces it drained into the grads plane."""

    drained: int


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """GpuExecutor.evaluate's request: forward-only passes (one weight walk per batch) with the weights after
    step-1's update. A batch is (ids, labels), or (ids, labels, positions) with data.pack_documents."""

    step: int
    batches: list[tuple[torch.Tensor, ...]]


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """GpuExecutor.generate's request: greedy decoding of exactly `new_tokens` tokens with the weights after
    step-1's update (one weight walk each); row r of `ids` continues after position pos[r]."""

    step: int
    ids: torch.Tensor
    pos: torch.Tensor
    new_tokens: int


@dataclass(frozen=True, kw_only=True)
class EvalSums:
    """GpuExecutor.evaluate's answer, its sums over its batches: the token loss, the labelled tokens, the
    executor's seconds."""

    loss_sum: float
    tokens: int
    eval_s: float


@dataclass(frozen=True, kw_only=True)
class WriteRequest:
    """CheckpointWriter.write's request: the state after `step` into a checkpoint under the directory `root`,
    with `meta` in its manifest."""

    step: int
    root: str
    meta: dict


@dataclass(frozen=True, kw_only=True)
class Written:
    """CheckpointWriter.write's answer, a checkpoint written (not yet published): where it will be, its
    bytes, the seconds the write took, how long of that it waited for Adam's updates, and whether every
    file was written with direct I/O."""

    path: str
    bytes: int
    seconds: float
    waited_for_adam_s: float
    direct_io: bool


@dataclass(frozen=True, kw_only=True)
class StoreRequest:
    """StoreOwner.create's request: what it plans, makes and fills the store from. `engine` may still have `auto` sizes
    (the driver chooses them while the store is made; settle() gets the chosen ones). `batch_shape`
    (sequences, tokens each) sizes the executor's pinned checkpoints for the fit check; `resume`: a
    checkpoint directory to fill from; `about`: what the driver adds to the run's description in ctl
    (megatrain-launch status)."""

    run_id: str
    model: ModelConfig
    no_decay_1d: bool
    clip: bool
    engine: EngineConfig
    num_packers: int
    num_accumulators: int
    ipc: IpcConfig
    batch_shape: tuple[int, int] = (0, 0)
    resume: str | None = None
    threads: ThreadRequest = field(default_factory=ThreadRequest)
    about: dict = field(default_factory=dict)
    executors: int = 1  # actors.num_gpus, resolved
    spec: ModelSpec | None = None  # the model's spec as the driver built it; None: built here from `model`
    memory: MemoryPlan  # the run's plan (launch/config/memplan.py run_plan): its staging mode and processes' reserve
    hosts: int = 1  # actors.num_hosts, resolved: the store is host `host`'s of `hosts` (its slice of the fp32 state)
    host: int = 0


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """StoreOwner.host_memory's answer, the host memory of a run's processes on the owner's node as PSS: how
    many, their total (the shared store counted once, split among the processes that map it), and per role
    what each costs outside the store (roles sharing a process, as in the in-process runner, named together
    with '+')."""

    processes: int
    pss_bytes: int
    pss_own_by_role: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class FillReport:
    """StoreOwner.fill_report's answer, how the store was filled: from what (a checkpoint directory,
    model.pretrained, or 'init'), the bytes read (0 for a fresh init) and the seconds it took."""

    source: str
    bytes: int
    seconds: float
