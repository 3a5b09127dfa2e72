"""Gradient-accumulation worker: drains gradient slabs into the fp32 gradient plane.

On the GPU it first synchronizes the slab's interprocess CUDA event (opened from the executor's
handle), so it reads only after the D2H copy has finished, while the executor never blocks on it.
It records each piece's squared norm for global-norm clipping, then frees the slab (back-pressure).
"""

from __future__ import annotations

from megatrain.actors.base import Role, guarded
from megatrain.host.hostops import warm_up
from megatrain.ipc.messages import Drained
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.ipc.protocol.workers import drain
from megatrain.roster import Kind, role_name


class GradAccumulator(Role):
    def __init__(self, index: int):
        super().__init__(role_name(Kind.ACCUMULATOR, index))
        self.index = index
        warm_up()  # compiled (or loaded from Numba's cache) while the store is being made, not in a step

    def attach(self, spec: StoreSpec) -> None:
        self.apply_threads(spec)
        self.items = spec.grad_items(self.index)
        self.store = Store.attach(spec, ("grads", "staging"), role=self.name)

    @guarded
    def step(self, step: int) -> Drained:
        for item in self.items:
            drain(self.store, self.events, item, step)
        return Drained(drained=len(self.items))
