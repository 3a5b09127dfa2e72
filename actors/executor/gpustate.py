"""The optimizer of the units the executor's device holds (engine.gpu_optimizer): their fp32 master weights,
both Adam moments, the weights in the compute dtype the engine reads, and the step's gradient while it waits
for the global norm.

Their gradients come last in the backward (the embedding's last of all), so a host update of them could only
start after it and the next forward would wait for it. Here the source serves their weights from the device,
the sink keeps their gradient there (its pieces' squared norms go to ctl as any unit's, so Adam's global norm
counts them), and once Adam has published its verdict on the step (the norm and the clip scale) the executor
updates them with the same arithmetic, bit for bit, as the host's kernel (megatrain/host/adamw.py
adamw_tensors): the next forward starts at once while Adam updates the other units ahead of it.

Their state in the store's planes is what was last written back (flush): before a checkpoint is written, and
before the final weights are read; the checkpoint writer takes those pieces at the version flush publishes.

With several executors sharing one store the units are shared among them (StoreSpec.gpu_owner): each holds the
state of its own, receives their summed gradient (actors/executor/reduce.py), updates them, and sends their new
weights to the others, which hold every unit's weights in the compute dtype.
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
        self.dirty = False  # updated since the last write-back
        self.for_writer: int | None = None  # the step the last write-back was published at, for the writer

    @property
    def loaded(self) -> bool:
        return bool(self.served) or not self.units

    def load(self, step: int) -> None:
        """The units' state from the planes (once, before the first walk): the weights after step-1's update."""
        if self.loaded:
            return
        for unit in self.order:
            self.store.wait_version(unit, step, f"unit {unit}'s state before step {step} (to hold it on the GPU)")
            numel = self.store.spec.layout.structure_of(unit).numel
            parts = STATE if unit in self.mine else STATE[:1]  # another executor's: its weights alone
            held = [self._to_device(self.store.span(part, unit, 0, numel)) for part in parts]
            if unit in self.mine:
                self.state[unit] = (held[0], held[1], held[2])
            self.served[unit] = held[0] if self.dtype == torch.float32 else held[0].to(self.dtype)

    def _to_device(self, host) -> torch.Tensor:  # noqa: ANN001 - a numpy view of a plane
        out = torch.empty(host.shape, dtype=torch.float32, device=self.device)
        out.copy_(torch.from_numpy(host))  # a copy on the CPU device too: never a view of the plane
        return out

    def weights(self, unit: int) -> torch.Tensor:
        """The unit's flat weights for the engine (it marks them as needing grad: a detached alias)."""
        return self.served[unit].detach()

    def keep(self, unit: int, grad: torch.Tensor) -> None:
        """The unit's gradient of the step, in the dtype the host's Adam would read it in (another executor's
        unit: not kept here, its owner keeps it)."""
        if unit in self.mine:
            self.grads[unit] = grad

    def update(self, step: int, lr: float, norm: float, scale: float, group: Group | None = None) -> int:
        """AdamW step `step` (0-based) on every unit this executor owns, with Adam's verdict (a non-finite norm:
        the step is skipped whole, as on the host), then each unit's new weights from its owner to the others
        over `group` (every executor of the host; None: one executor). The units this executor updated (a step's
        report sums the executors')."""
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
            served = self.served[unit]
            split = layout.structure_of(unit).decay_split()
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
                        out=None if served is p else served[sl],
                    )
        for unit in self.order if group is not None else ():
            group.broadcast_(self.served[unit], self.owner[unit], part="stats")
        self.dirty = True
        return len(self.mine)

    def flush(self, step: int | None) -> int:
        """Write the state of the units this executor owns back into the planes; `step`: the checkpoint writer
        takes it as the state after `step` steps (published at that version), None: for a reader without versions
        (the final weights). The bytes written."""
        store, written = self.store, 0
        if self.for_writer is not None:  # the writer may still read the last write-back's pieces
            for unit in self.mine:
                for piece in range(store.spec.piece_range(unit).start, store.spec.piece_range(unit).stop):
                    store.wait_saved(piece, self.for_writer, f"the checkpoint writer to take unit {unit}")
            self.for_writer = None
        if self.dirty or step is not None:
            for unit in self.mine:
                for part, tensor in zip(STATE, self.state[unit], strict=True):
                    host = store.span(part, unit, 0, tensor.numel())
                    torch.from_numpy(host).copy_(tensor)
                    written += tensor.numel() * 4
            self.dirty = False
        if step is not None:
            for unit in self.mine:
                rng = store.spec.piece_range(unit)
                for piece in range(rng.start, rng.stop):
                    store.publish_version(piece, step)
            self.for_writer = step
        return written
