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

Over several hosts (update_clipped_hosts, update_unclipped_hosts) each host updates its own pieces (its slice
of every unit), then, unit by unit, the hosts gather the unit's updated compute-dtype slices into every host's
resident copy (while the next unit is updated), and only then is every piece of the unit published: the next
forward on any host reads the whole unit. Every host makes the same collective calls in the same order (a host
owning no piece of a unit still joins its gather), and a decision to skip or stop rests on numbers all-reduced
over the hosts, so that every host takes it alike instead of one waiting on a collective the others never enter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatrain.adamw import clip_scale
from megatrain.collective import Group, SliceExchange
from megatrain.errors import NonFiniteGradient, ProtocolError
from megatrain.hostops import sqnorm
from megatrain.ipc.protocol.checkpoints import wait_taken
from megatrain.ipc.protocol.messages import Applied
from megatrain.ipc.protocol.plan import Item, StoreSpec
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
        start = time.time()
        _clipped_piece(store, item, step, saving, finite, scale, update)
        store.publish_version(item.piece, step + 1)
        spans.append((item.unit, start, time.time()))
    return Applied(grad_norm=norm, clip_scale=scale, skipped=not finite, unit_spans=tuple(spans))


def _clipped_piece(
    store: Store, item: Item, step: int, saving: bool, finite: bool, scale: float, update: PieceUpdate
) -> None:
    """One piece of a step with clipping, once the global norm is known (its version is the caller's)."""
    grads = store.grad_tile(item.unit)
    if saving:
        wait_taken(store, item, step)
    if finite:  # else the step is skipped whole: no piece has been touched
        update(item, grads[item.lo : item.hi], scale)
    elif store.spec.grads_in_resident:  # the tile holds the gradient: the weights back, unchanged
        store.refresh_resident(item.unit, item.lo, item.hi)


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


@dataclass(frozen=True, kw_only=True)
class HostsLink:
    """An updater's link to the other hosts' updaters: their group (gloo, rank = host) for the sums every host
    decides by, and the exchange of each unit's updated slices (in place in the resident copies: no buffer)."""

    group: Group
    exchange: SliceExchange

    @classmethod
    def make(cls, spec: StoreSpec, group: Group) -> HostsLink:
        """`group`: the hosts' updaters' statistics group; the exchange's groups form over its rendezvous (every
        host's updater at once)."""
        if (group.rank, group.size) != (spec.host, spec.hosts):
            raise ProtocolError(
                f"the hosts' group has rank {group.rank} of {group.size}; the store is host {spec.host} of {spec.hosts}"
            )
        exchange = SliceExchange(
            group.rendezvous, group.rank, group.size, group.timeout_s, group.check, bind=group.bind
        )
        return cls(group=group, exchange=exchange)

    def totals(self, *values: float) -> tuple[float, ...]:
        """`values` each summed over the hosts, in float64 (the same answer on every host)."""
        t = torch.tensor(values, dtype=torch.float64)
        self.group.all_reduce_(t)
        return tuple(t.tolist())

    def start_gather(self, store: Store, unit: int) -> Gathering:
        """Every host's updated slice of the unit's resident copy (its compute dtype) into every host's copy, on
        gloo's threads while the caller goes on; `settle` finishes it and publishes the unit."""
        spec = store.spec
        ranges = [spec.slice_of(unit, h) for h in range(spec.hosts)]
        return Gathering(unit=unit, works=tuple(self.exchange.start(store.resident_tile(unit), ranges)))

    def settle_done(self, store: Store, gathering: Gathering | None, version: int) -> Gathering | None:
        """Settle the gather if it has finished (the unit published now, not after the next unit's update);
        returns what is still pending."""
        if gathering is None or not all(w.is_completed() for w in gathering.works):
            return gathering
        self.settle(store, gathering, version)
        return None

    def settle(self, store: Store, gathering: Gathering | None, version: int) -> None:
        """The unit's gather finished, then every piece of it published at `version` (None: nothing pending)."""
        if gathering is not None:
            self.exchange.finish(gathering.works)
            _publish_unit(store, gathering.unit, version)


@dataclass(frozen=True)
class Gathering:
    """A unit's gather under way: the exchange's works, finished before the unit is published."""

    unit: int
    works: tuple[Any, ...] = ()


def update_clipped_hosts(
    store: Store, hosts: HostsLink, step: int, saving: bool, max_grad_norm: float, update: PieceUpdate
) -> Applied:
    """Step `step` with clipping over several hosts: this host's pieces, with the norm of every host's; unit by
    unit in forward order the update, then the gather of the unit's slices, going on while the next unit is
    updated, then every piece of the unit published. A non-finite norm (the same on every host) skips the step
    whole on every host: no gather is needed, the other hosts' slices of the copy never left the unchanged
    weights."""
    spec = store.spec
    wait_all_grads(store, step)
    own = spec.update_items
    (total,) = hosts.totals(float(store.sqnorms[[it.piece for it in own]].sum()))
    norm = math.sqrt(total)
    finite, scale, spans, pending = math.isfinite(norm), clip_scale(norm, max_grad_norm), [], None
    for unit, items in _by_unit(own, spec.forward_order):
        pending = hosts.settle_done(store, pending, step + 1)
        for item in items:
            start = time.time()
            _clipped_piece(store, item, step, saving, finite, scale, update)
            spans.append((item.unit, start, time.time()))
        now = hosts.start_gather(store, unit) if finite else Gathering(unit=unit)
        hosts.settle(store, pending, step + 1)
        pending = now
    hosts.settle(store, pending, step + 1)
    return Applied(grad_norm=norm, clip_scale=scale, skipped=not finite, unit_spans=tuple(spans))


def update_unclipped_hosts(store: Store, hosts: HostsLink, step: int, saving: bool, update: PieceUpdate) -> Applied:
    """Step `step` without clipping over several hosts: unit by unit in the gradient's order, this host's
    pieces as they arrive (in the resident copy); before the unit is touched the hosts add up how many of its
    pieces are non-finite, so an inf or NaN on any host stops every host at the same unit (the unit before it
    gathered and published first, as on every host)."""
    spec, total, spans, pending = store.spec, 0.0, [], None
    for unit, items in _by_unit(spec.update_items, spec.grad_order):
        grads = [_arrived(store, item, step) for item in items]
        for item in items if saving else ():
            wait_taken(store, item, step)
        sq = [float(store.sqnorms[item.piece]) for item in items]
        bad, part = hosts.totals(sum(not math.isfinite(x) for x in sq), math.fsum(x for x in sq if math.isfinite(x)))
        if bad:
            hosts.settle(store, pending, step + 1)
            raise NonFiniteGradient(_non_finite(store, step, unit))
        total += part
        pending = hosts.settle_done(store, pending, step + 1)
        for item, grad in zip(items, grads, strict=True):
            start = time.time()
            update(item, grad, 1.0)
            spans.append((item.unit, start, time.time()))
        now = hosts.start_gather(store, unit)
        hosts.settle(store, pending, step + 1)
        pending = now
    hosts.settle(store, pending, step + 1)
    return Applied(grad_norm=math.sqrt(total), clip_scale=1.0, skipped=False, unit_spans=tuple(spans))


def _by_unit(items: Sequence[Item], order: Sequence[int]) -> list[tuple[int, list[Item]]]:
    """This host's items per unit of `order`, every unit listed (one this host owns no piece of too: it still
    joins the unit's collectives)."""
    mine: dict[int, list[Item]] = {}
    for item in items:
        mine.setdefault(item.unit, []).append(item)
    return [(unit, mine.get(unit, [])) for unit in order]


def _publish_unit(store: Store, unit: int, version: int) -> None:
    """Every piece of the unit, every host's, at `version`: the next forward reads the unit whole."""
    pieces = store.spec.piece_range(unit)
    for piece in range(pieces.start, pieces.stop):
        store.publish_version(piece, version)


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
