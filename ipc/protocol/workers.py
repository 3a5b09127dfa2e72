"""The protocol verbs of the host workers: packers fill weight slabs, accumulators drain gradient
slabs, the Adam updater takes gradients and publishes versions. The actors call these and nothing
lower; the order of waits and posts lives here, next to the plan it follows."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatrain.host.hostops import copy_sqnorm
from megatrain.ipc.protocol.plan import Item
from megatrain.ipc.protocol.sems import GRADS_READY, g_free, g_full, w_free, w_full
from megatrain.ipc.protocol.store import Store


def pack(store: Store, item: Item, step: int) -> None:
    """Packer: the piece's fp32 weights after step-1's update, cast into its weight slab."""
    unit, lo, hi, slab, piece = item
    store.wait(w_free(slab), f"weight slab {slab} to be free (unit {unit}, step {step})")
    store.wait_version(unit, step, f"Adam's update of unit {unit} before step {step}", piece)
    store.weight_slab(slab)[: hi - lo].copy_(store.torch_tile("params", unit)[lo:hi])
    store.post(w_full(slab))


def take_grad(store: Store, events: list[Any] | None, item: Item, step: int) -> np.ndarray:
    """Wait for the item's gradient slab to hold its piece (and, on the GPU, for its D2H copy, through the
    slab's interprocess event); the piece as a numpy view of the slab. Hand the slab back with free_grad."""
    store.wait(g_full(item.slab), f"the gradient of unit {item.unit} (step {step})")
    if events is not None:
        events[item.slab].synchronize()
    return store.grad_slab(item.slab)[: item.hi - item.lo].numpy()


def free_grad(store: Store, item: Item) -> None:
    store.post(g_free(item.slab))


def drain(store: Store, events: list[Any] | None, item: Item, step: int) -> None:
    """Accumulator: the piece's gradient into the fp32 grads plane and its squared norm into ctl (both
    handed to Adam through grads_ready, a semaphore: memory-synchronizing)."""
    grad = take_grad(store, events, item, step)
    store.sqnorms[item.piece] = copy_sqnorm(grad, store.tile("grads", item.unit)[item.lo : item.hi])
    free_grad(store, item)
    store.post(GRADS_READY)


def wait_all_grads(store: Store, step: int) -> None:
    """Adam with clipping: every piece of the step's gradient that this host updates is in (the grads plane or
    the resident copy): all of them on one host, this host's own over several."""
    pieces = len(store.spec.update_items)
    for i in range(pieces):
        store.wait(GRADS_READY, f"the gradients of step {step} ({i} of {pieces} pieces arrived)")
