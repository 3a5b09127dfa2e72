"""The optimizer of the units the executor's device holds (engine.gpu_optimizer): their fp32 master weights,
both Adam moments, the weights in the compute dtype the engine reads, and the step's gradient while it waits
for the global norm.

Their gradients come last in the backward (the embedding's last of all), so a host update of them could only
start after it and the next forward would wait for it. Here the source serves their weights from the device,
the sink keeps their gradient there (its pieces' squared norms go to ctl as any unit's, so Adam's global norm
counts them), and once Adam has published its verdict on the step (the norm and the clip scale) the executor
updates them with the same arithmetic, bit for bit, as the host's kernel (megatrain/host/adamw.py
adamw_tensors): the next forward starts at once while Adam updates the other units ahead of it.

Once loaded, their state leaves the host: its pages in the store's planes are given back to the system (the
planes read zeros there). It is written back (flush) before a checkpoint is written, and before the final
weights are read; the checkpoint writer takes those pieces at the version flush publishes, and once it has them
on disk the pages are given back again (settle, at the next update). The host's peak is the start-up's: the
store owner fills every unit's state before the executor takes the held ones'.

With several executors sharing one store the units are shared among them (StoreSpec.gpu_owner): each holds the
state of its own, receives their summed gradient (actors/executor/reduce.py), updates them, and sends their new
weights to the others, which hold every unit's weights in the compute dtype. Over several hosts each host holds
the state of its own slice of a unit (StoreSpec.owned, as its planes do) on the GPU of the unit's owner among its
executors, which updates that slice from the run's summed gradient of it (the hosts' reduce-scatter) and sends
it to every executor of every host: a unit's new weights come from one executor of each host, slice by slice.
"""

from __future__ import annotations

import math

import torch

from megatrain.collective import Group
from megatrain.config.optim import OptimConfig
from megatrain.errors import ProtocolError
from megatrain.host.adamw import adamw_tensors
from megatrain.ipc.protocol import STAGING, Store

STATE = ("params", "exp_avg", "exp_avg_sq")  # the planes a unit's state lives in, in this order


class GpuState:
    """The units of `store.spec.on_gpu`, held on `device` once loaded (load, at the first walk): the state of
    those executor `rank` owns, the weights of all of them."""

    def __init__(self, store: Store, device: torch.device, dtype: torch.dtype, optim: OptimConfig, rank: int = 0):
        self.store, self.device, self.dtype, self.optim = store, device, dtype, optim
        spec = store.spec
        self.units = spec.on_gpu
        self.order = [u for u in spec.forward_order if u in self.units]
        self.owner = spec.gpu_owner
        self.mine = [u for u in self.order if self.owner[u] == rank]
        self.grad_dtype = STAGING[spec.staging_dtype][0]  # as the resident copy would hold the gradient
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # p, m, v (fp32)
        self.served: dict[int, torch.Tensor] = {}  # the weights the engine reads (p itself in fp32)
        self.grads: dict[int, torch.Tensor] = {}  # this step's, until the update
        self.slices = {u: spec.owned(u) for u in self.units}  # this host's elements of each (one host: all)
        self.dirty = False  # the planes do not hold the state: updated, or given back, since the last write-back
        self.for_writer: int | None = None  # the step the last write-back was published at, for the writer
        self.released = 0  # bytes of the planes given back so far (a report's)

    @property
    def loaded(self) -> bool:
        return bool(self.served) or not self.units

    def load(self, step: int) -> None:
        """The units' state (once, before the first walk): the weights after step-1's update. Every unit's
        weights whole from the resident copy (the compute dtype, every host's copy whole, as the store was filled
        or restored: no executor waits for another, so a walk of one alone, an evaluation, may load), and the
        state of this executor's own (this host's slice of them) from the planes, whose pages are then given
        back to the system (release): the host keeps none of it until a write-back."""
        if self.loaded:
            return
        for unit in self.order:
            self.store.wait_version(unit, step, f"unit {unit}'s state before step {step} (to hold it on the GPU)")
            resident = self.store.resident_tile(unit)
            if resident.dtype != self.dtype:
                raise ProtocolError(f"unit {unit}: the resident copy is {resident.dtype}, the engine's {self.dtype}")
            served = torch.empty(resident.numel(), dtype=self.dtype, device=self.device)
            served.copy_(resident)
            self.served[unit] = served
            if unit not in self.mine:
                continue
            lo, hi = self.slices[unit]
            held = [self._to_device(self.store.span(part, unit, lo, hi)) for part in STATE]
            if self.dtype == torch.float32:  # the master weights are what the engine reads: one tensor
                served[lo:hi] = held[0]
                held[0] = served[lo:hi]
            self.state[unit] = (held[0], held[1], held[2])
            self._release(unit)

    def _release(self, unit: int) -> None:
        """Give the unit's pages in the state planes back (Store.release): its state is on the device, copied
        (_to_device waits for the copy). Given back, the planes no longer hold it: the next flush writes it."""
        given = sum(self.store.release(part, unit) for part in STATE)
        self.released += given
        self.dirty = self.dirty or given > 0

    def settle(self) -> None:
        """Give back the pages of the last write-back once nothing on the host reads them any more: the
        checkpoint writer has the pieces on disk (a write-back for the final weights stays: the run ends)."""
        step, spec = self.for_writer, self.store.spec
        if step is None or not all(self.store.has_saved(p, step) for u in self.mine for p, _, _ in spec.pieces_of(u)):
            return
        self.for_writer = None
        for unit in self.mine:
            self._release(unit)

    def _to_device(self, host) -> torch.Tensor:  # noqa: ANN001 - a numpy view of a plane
        out = torch.empty(host.shape, dtype=torch.float32, device=self.device)
        out.copy_(torch.from_numpy(host))  # a copy on the CPU device too: never a view of the plane
        return out

    def weights(self, unit: int) -> torch.Tensor:
        """The unit's flat weights for the engine (it marks them as needing grad: a detached alias)."""
        return self.served[unit].detach()

    def keep(self, unit: int, grad: torch.Tensor) -> None:
        """The unit's gradient of the step (its whole length; over several hosts only this host's slice holds the
        run's sum, and only it is kept), in the dtype the host's Adam would read it in (another executor's unit:
        not kept here, its owner keeps it)."""
        if unit not in self.mine:
            return
        lo, hi = self.slices[unit]
        # a copy of a slice: a view would keep the whole gradient alive until the update
        self.grads[unit] = grad.detach()[lo:hi].to(self.grad_dtype, copy=hi - lo < grad.numel())

    def update(self, step: int, lr: float, norm: float, scale: float, group: Group | None = None) -> int:
        """AdamW step `step` (0-based) on every unit this executor owns, with Adam's verdict (a non-finite norm:
        the step is skipped whole, as on the host), then each unit's new weights from its owner to the others
        over `group` (every executor of the run; None: one executor of one host). The units this executor updated
        (a step's report sums the executors')."""
        self.settle()
        grads, self.grads = self.grads, {}
        if set(grads) != set(self.mine):
            missing = sorted(set(self.mine) - set(grads))
            raise ProtocolError(f"step {step}: no gradient for the GPU's units {missing}")
        if not math.isfinite(norm):
            return 0
        layout = self.store.spec.layout
        for unit in self.mine:
            if self.device.type == "cuda":  # made on the reducer's stream: not reused before the update is done
                grads[unit].record_stream(torch.cuda.current_stream(self.device))
            p, m, v = self.state[unit]
            lo, hi = self.slices[unit]
            out = None if self.dtype == torch.float32 else self.served[unit][lo:hi]  # fp32: p is the served slice
            # the slice's decayed elements first (the unit's are its first `split`), as the host's pieces split
            split = min(max(layout.structure_of(unit).decay_split() - lo, 0), hi - lo)
            for sl, wd in ((slice(0, split), self.optim.weight_decay), (slice(split, None), 0.0)):
                if p[sl].numel():
                    adamw_tensors(
                        p[sl],
                        grads[unit][sl],
                        m[sl],
                        v[sl],
                        step=step + 1,
                        lr=lr,
                        cfg=self.optim,
                        weight_decay=wd,
                        grad_scale=scale,
                        out=None if out is None else out[sl],
                    )
        self._share(group)
        self.dirty = True
        # a unit once in the run's count: over several hosts each updates its slice, the first's never empty
        return len(self.mine) if self.store.spec.host == 0 else 0

    def _share(self, group: Group | None) -> None:
        """Each unit's weights from its owners to every executor of the run over `group` (None: one executor of
        one host): the owner's on each host sends that host's slice (one host: the whole unit)."""
        if group is None:
            return
        spec = self.store.spec
        for unit in self.order:
            for host in range(spec.hosts):
                lo, hi = spec.slice_of(unit, host)
                if hi > lo:
                    src = host * spec.num_executors + self.owner[unit]  # the run's group: host-major ranks
                    group.broadcast_(self.served[unit][lo:hi], src, part="stats")

    def flush(self, step: int | None) -> int:
        """Write the state of the units this executor owns back into the planes; `step`: the checkpoint writer
        takes it as the state after `step` steps (published at that version), None: for a reader without versions
        (the final weights). The bytes written."""
        store, written = self.store, 0
        if not self.loaded:  # no step has run: the planes hold the state as the store was filled
            return 0
        if self.for_writer is not None:  # the writer may still read the last write-back's pieces
            for unit in self.mine:
                for piece, _, _ in store.spec.pieces_of(unit):
                    store.wait_saved(piece, self.for_writer, f"the checkpoint writer to take unit {unit}")
            self.for_writer = None
        if self.dirty or step is not None:
            for unit in self.mine:
                lo, hi = self.slices[unit]
                for part, tensor in zip(STATE, self.state[unit], strict=True):
                    torch.from_numpy(store.span(part, unit, lo, hi)).copy_(tensor)
                    written += tensor.numel() * 4
            self.dirty = False
        if step is not None:
            for unit in self.mine:
                for piece, _, _ in store.spec.pieces_of(unit):
                    store.publish_version(piece, step)
            self.for_writer = step
        return written
