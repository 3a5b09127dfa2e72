"""Pinned-packing worker: casts fp32 master tiles into the compute-dtype slabs that the DMA reads.

Runs ahead of the executor by up to S slabs, and never packs a piece of a unit before Adam's update
of that piece for the previous step has landed (its version counter), so the next forward can start
while Adam still works on later pieces.
"""

from __future__ import annotations

from megatrain.actors.base import Role, guarded
from megatrain.ipc.messages import Packed
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.ipc.protocol.workers import pack
from megatrain.roster import Kind, role_name


class Packer(Role):
    def __init__(self, index: int):
        super().__init__(role_name(Kind.PACKER, index))
        self.index = index

    def attach(self, spec: StoreSpec) -> None:
        self.apply_threads(spec)  # torch's threads do the cast
        self.items = {walk: spec.weight_items(self.index, walk) for walk in ("step", "forward")}
        self.store = Store.attach(spec, ("params", "staging"), role=self.name)

    @guarded
    def step(self, step: int, walk: str = "step", repeat: int = 1) -> Packed:
        """Pack `repeat` walks of kind `walk` ('forward': the executor's evaluation and generation passes)
        with the weights after step-1's update."""
        items = self.items[walk]
        for _ in range(repeat):
            for item in items:
                pack(self.store, item, step)
        return Packed(packed=len(items) * repeat)
