"""The Adam updater's side of the protocol: which gradient it waits for, in what order it updates the pieces,
when it may write a piece (after the checkpoint writer has taken it), and when the next step may read it
(its version, published after the update). actors/adam_updater.py supplies the AdamW arithmetic of one piece
(`PieceUpdate`) and calls these; nothing in it touches a version, a semaphore or a slab.

With clipping every piece's gradient is in (the fp32 grads plane, or the resident copy) before the global
norm is known; the pieces are then updated in forward order, each version published right after its update,
so the next step's forward follows right behind. A non-finite norm skips the step whole: no piece is touched
(a resident copy holding the gradient gets the unchanged weights back), every version is still published.
Without clipping each piece is updated as its gradient arrives, in the backward's order: from its gradient
slab (its squared norm computed here, the slab freed after the update) or, with grads_in_resident, from the
resident copy, where the executor wrote it and its squared norm.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from megatrain.adamw import clip_scale
from megatrain.errors import NonFiniteGradient
from megatrain.hostops import sqnorm
from megatrain.ipc.protocol.checkpoints import wait_taken
from megatrain.ipc.protocol.messages import Applied
from megatrain.ipc.protocol.plan import Item
from megatrain.ipc.protocol.sems import GRADS_READY
from megatrain.ipc.protocol.store import Store
from megatrain.ipc.protocol.workers import free_grad, take_grad, wait_all_grads

# The AdamW update of one piece: (item, its gradient, elements [item.lo, item.hi) of the unit, the clip scale).
PieceUpdate = Callable[[Item, np.ndarray, float], None]


def update_clipped(store: Store, step: int, saving: bool, max_grad_norm: float, update: PieceUpdate) -> Applied:
    """Step `step` with global-norm clipping. `saving`: the checkpoint of the state after `step` steps is being
    written; each piece waits until the writer has it."""
    wait_all_grads(store, step)
    norm = math.sqrt(float(store.sqnorms.sum()))
    finite, scale, spans = math.isfinite(norm), clip_scale(norm, max_grad_norm), []
    for item in store.spec.update_items:  # forward order: the next step's packer follows right behind
        start, grads = time.time(), store.grad_tile(item.unit)
        if saving:
            wait_taken(store, item, step)
        if finite:  # else the step is skipped whole: no piece has been touched
            update(item, grads[item.lo : item.hi], scale)
        elif store.spec.grads_in_resident:  # the tile holds the gradient: the weights back, unchanged
            store.refresh_resident(item.unit, item.lo, item.hi)
        store.publish_version(item.piece, step + 1)
        spans.append((item.unit, start, time.time()))
    return Applied(grad_norm=norm, clip_scale=scale, skipped=not finite, unit_spans=tuple(spans))


def update_unclipped(store: Store, events: list[Any] | None, step: int, saving: bool, update: PieceUpdate) -> Applied:
    """Step `step` without clipping: each piece as its gradient arrives. A step cannot be skipped whole: an inf
    or NaN piece stops the run (the pieces before it are already updated; no version is published for it, so
    nothing reads the half-applied step)."""
    spans = []
    direct = store.spec.grads_in_resident  # the executor wrote the piece and its squared norm
    for item in store.spec.update_items:
        grad = _arrived(store, item, step) if direct else take_grad(store, events, item, step)
        start = time.time()
        if saving:
            wait_taken(store, item, step)
        if not direct:
            store.sqnorms[item.piece] = sqnorm(grad)
        if not math.isfinite(store.sqnorms[item.piece]):
            raise NonFiniteGradient(_non_finite(store, step, item.unit))
        update(item, grad, 1.0)
        store.publish_version(item.piece, step + 1)
        if not direct:
            free_grad(store, item)
        spans.append((item.unit, start, time.time()))
    return Applied(
        grad_norm=math.sqrt(float(store.sqnorms.sum())), clip_scale=1.0, skipped=False, unit_spans=tuple(spans)
    )


def _arrived(store: Store, item: Item, step: int) -> np.ndarray:
    """The next piece in the resident copy: pieces arrive (grads_ready) in the order they are updated without
    clipping, the gradient order, so the k-th post is the k-th piece."""
    store.wait(GRADS_READY, f"the gradient of unit {item.unit} (step {step})")
    return store.grad_tile(item.unit)[item.lo : item.hi]


def _non_finite(store: Store, step: int, unit: int) -> str:
    layout = store.spec.layout
    what = (
        "the embedding"
        if unit == 0
        else "the final norm and LM head"
        if unit == layout.num_layers + 1
        else f"layer {unit - 1}"
    )
    return (
        f"non-finite gradient (inf or NaN) at step {step + 1} in unit {unit} ({what}). Without clipping "
        f"(optim.max_grad_norm: 0) Adam updates each unit as its gradient arrives, so the units whose "
        f"gradients came first (the head and the layers above) were already updated and the step cannot be "
        f"skipped whole: the run stops. Set optim.max_grad_norm > 0 to skip such steps whole instead"
    )
