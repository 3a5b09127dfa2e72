"""The executor's verbs on the data plane: the walk it must follow, and each hand-off of a piece with the host
workers (a weight slab or a resident tile to read, a gradient slab to fill, a gradient in the resident copy
to announce). The executor's sources and sinks (actors/executor/streams.py) run these from their threads;
the semaphores, slabs, versions and squared norms are touched here alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatrain.errors import ProtocolError
from megatrain.ipc.protocol.plan import Item
from megatrain.ipc.protocol.sems import GRADS_READY, g_free, g_full, w_free, w_full
from megatrain.ipc.protocol.store import Store


class Walk:
    """One direction of the protocol's walk in a step: checks that the engine follows `order` and
    hands out each entry's pieces (its items)."""

    def __init__(self, order: list[int], items: list[list[Item]], what: str):
        self.order, self.items, self.what, self.i = order, items, what, 0

    def next(self, unit: int) -> list[Item]:
        if self.i >= len(self.order) or unit != self.order[self.i]:
            expected = self.order[self.i] if self.i < len(self.order) else "nothing more"
            raise ProtocolError(
                f"the engine {self.what} unit {unit} at position {self.i} of the walk; the plan "
                f"says {expected} (the store would have served another unit's tile)"
            )
        self.i += 1
        return self.items[self.i - 1]


def weights(store: Store, item: Item, step: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Wait until the piece's weights after step-1's update are readable on the host; (host tensor, release or
    None when nothing is to be freed: a resident tile changes only after the unit's last use in the step)."""
    unit = item.unit
    if store.spec.resident:
        store.wait_version(unit, step, f"Adam's update of unit {unit} before step {step}", item.piece)
        return store.resident_tile(unit)[item.lo : item.hi], None
    store.wait(w_full(item.slab), f"weights of unit {unit} in slab {item.slab}")
    return store.weight_slab(item.slab)[: item.hi - item.lo], lambda: store.post(w_free(item.slab))


def check_resident_write(store: Store, unit: int, taken: int) -> None:
    """A gradient may overwrite its unit's resident tile only once the unit's last fetch of the step is behind
    the engine (`taken` fetches so far); raises otherwise (it would overwrite weights yet to be read)."""
    if store.spec.last_fetch[unit] >= taken:
        raise ProtocolError(
            f"the gradient of unit {unit} arrived at fetch {taken} of the step, but its weights "
            f"are fetched again at position {store.spec.last_fetch[unit]}: it would overwrite them "
            "in the resident copy"
        )


def free_grad_slab(store: Store, item: Item) -> torch.Tensor:
    """Wait for the item's gradient slab to be free; the part of it the piece fills (fp32)."""
    store.wait(g_free(item.slab), f"a free gradient slab for unit {item.unit}")
    return store.grad_slab(item.slab)[: item.hi - item.lo]


def grad_sent(store: Store, item: Item) -> None:
    """The piece's gradient is in its slab (on the GPU: its copy is issued and the slab's IPC event recorded)."""
    store.post(g_full(item.slab))


def grads_landed(store: Store, items: Sequence[Item], sqnorms: np.ndarray | Sequence[float]) -> None:
    """Consecutive pieces' gradients are in their resident tiles: their squared norms into ctl, then Adam is
    told, one grads_ready per piece (a semaphore: memory-synchronizing). None: a unit this host owns no piece of."""
    if not items:
        return
    store.sqnorms[items[0].piece : items[-1].piece + 1] = sqnorms
    for _ in items:
        store.post(GRADS_READY)
