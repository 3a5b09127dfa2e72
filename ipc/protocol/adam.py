"""The Adam updater's side of the protocol: which gradient it waits for, in what order it updates the pieces,
when it may write a piece (after the checkpoint writer has taken it), and when the next step may read it
(its version, published after the update). actors/adam_updater.py supplies the AdamW arithmetic of one piece
(`PieceUpdate`) and calls these; nothing in it touches a version, a semaphore or a slab.

One clipped and one unclipped update serve every run; what differs with the number of hosts is the link
(`Link`): each host updates its own pieces in batches the link cuts, the link sums the numbers every host
decides by, and it hands each updated batch on.
- One host (`OneHost`): a batch is one piece, its totals are its inputs, there is nothing to gather, and each
  piece's version is published right after its update, so the next forward may begin on a unit's first
  pieces while its last are still updated.
- Several hosts (`HostsLink`): a batch is this host's slice of a unit (possibly empty: a host owning no piece
  of a unit still joins its collectives); the totals are all-reduced over the hosts; the unit's updated
  compute-dtype slices are gathered into every host's resident copy while the next unit is updated, and only
  then is every piece of the unit published: the next forward on any host reads the whole unit. Every host
  makes the same collective calls in the same order, and a decision to skip or stop rests on numbers summed
  over the hosts, so every host takes it alike instead of one waiting on a collective the others never enter.

The units whose optimizer the executor holds (spec.on_gpu) count in the norm but are not updated here: once
the norm is known (with clipping, before any update; without, after the last gradient) Adam publishes its
verdict, the norm and the clip scale, and the executor updates them itself.
With clipping every piece's gradient is in (the fp32 grads plane, or the resident copy) before the global
norm is known; the pieces are then updated in forward order, so the next step's forward follows right
behind. A non-finite norm skips the step whole: no piece is touched (a resident copy holding the gradient
gets the unchanged weights back), every version is still published.
With spare slots (StoreSpec.spare_units, the resident copy) a clipped step may speculate: while the backward
runs, each unit with a slot is updated (this host's slice of it) as its gradients land, at clip scale 1, into
its slot, never over its state nor its gradient; it stops speculating once the squared norms landed so far
already clip (this host's: over several hosts they are part of the sum, so the sum clips too). Once the global
norm is known, a step that did not clip (finite, clip scale exactly 1) turns each speculated unit's bank, so
its slot becomes its state: the same operations on the same inputs, so the same bits. Any other step drops the
slots and updates every unit as without them. Every host takes the same decision (the norm is summed over the
hosts); which units each speculated is its own, and a unit is gathered and published as without slots.
Without clipping each batch is updated as its gradients arrive, in the backward's order: from the gradient
slab (its squared norm computed here, the slab freed after the update) or, with grads_in_resident, from the
resident copy, where the executor wrote it and its squared norm.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from megatrain.collective import Group, SliceExchange
from megatrain.errors import NonFiniteGradient, ProtocolError
from megatrain.host.adamw import clip_scale
from megatrain.host.hostops import sqnorm
from megatrain.ipc.messages import Applied
from megatrain.ipc.protocol.checkpoints import wait_taken
from megatrain.ipc.protocol.plan import Item, StoreSpec
from megatrain.ipc.protocol.sems import GRADS_READY
from megatrain.ipc.protocol.store import Store
from megatrain.ipc.protocol.workers import free_grad, take_grad, wait_all_grads

# The AdamW update of one piece: (item, its gradient, elements [item.lo, item.hi) of the unit, the clip scale,
# whether into the unit's spare slot, its state left as it was: a speculative update).
PieceUpdate = Callable[[Item, np.ndarray, float, bool], None]
Batches = list[tuple[int, list[Item]]]  # (unit, this host's items of it to update together)


@dataclass(frozen=True)
class Gathering:
    """A unit's gather under way: the exchange's works, finished before the unit is published."""

    unit: int
    works: tuple[Any, ...] = ()


class Link(Protocol):
    """What the update asks of the other hosts (one host: nothing)."""

    def batches(self, items: Sequence[Item], order: Sequence[int]) -> Batches:
        """This host's items, cut into the batches the update hands on together, in `order`'s units."""

    def totals(self, *values: float) -> tuple[float, ...]:
        """`values` each summed over the hosts (the same answer on every host)."""

    def hand_off(self, store: Store, unit: int, items: list[Item], version: int, changed: bool) -> Gathering | None:
        """A batch updated (`changed`: its weights were written): published now, or its gather started and
        returned, to be settled."""

    def settle_done(self, store: Store, pending: Gathering | None, version: int) -> Gathering | None:
        """Settle `pending` if its gather has finished; returns what is still pending."""

    def settle(self, store: Store, pending: Gathering | None, version: int) -> None:
        """Finish `pending`'s gather (None: nothing pending), then publish its unit at `version`."""

    def grad_norm(self, store: Store, summed: float) -> float:
        """The step's gradient norm without clipping, every piece updated; `summed`: the batches' totals."""


@dataclass(frozen=True)
class OneHost:
    """The link of a run on one host: a batch is one piece, its totals are its inputs, and each piece is
    published right after its update (nothing to gather, nothing pending)."""

    def batches(self, items: Sequence[Item], order: Sequence[int]) -> Batches:
        return [(item.unit, [item]) for item in items]  # `items` are every piece, already in `order`

    def totals(self, *values: float) -> tuple[float, ...]:
        return values

    def hand_off(self, store: Store, unit: int, items: list[Item], version: int, changed: bool) -> None:
        for item in items:
            store.publish_version(item.piece, version)

    def settle_done(self, store: Store, pending: Gathering | None, version: int) -> None:
        return None

    def settle(self, store: Store, pending: Gathering | None, version: int) -> None:
        return None

    def grad_norm(self, store: Store, summed: float) -> float:
        return math.sqrt(float(store.sqnorms.sum()))  # every piece's, summed as the clipped step sums them


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

    def batches(self, items: Sequence[Item], order: Sequence[int]) -> Batches:
        """Per unit of `order`, this host's items of it; every unit listed (one this host owns no piece of too:
        it still joins the unit's collectives)."""
        mine: dict[int, list[Item]] = {}
        for item in items:
            mine.setdefault(item.unit, []).append(item)
        return [(unit, mine.get(unit, [])) for unit in order]

    def totals(self, *values: float) -> tuple[float, ...]:
        """In float64: the same answer on every host."""
        t = torch.tensor(values, dtype=torch.float64)
        self.group.all_reduce_(t)
        return tuple(t.tolist())

    def hand_off(self, store: Store, unit: int, items: list[Item], version: int, changed: bool) -> Gathering:
        """Every host's updated slice of the unit's resident copy (its compute dtype) into every host's copy, on
        gloo's threads while the caller goes on. Unchanged (a skipped step): the other hosts' slices of the
        copy never left the unchanged weights, so there is nothing to gather, only the unit to publish."""
        if not changed:
            return Gathering(unit=unit)
        spec = store.spec
        ranges = [spec.slice_of(unit, h) for h in range(spec.hosts)]
        return Gathering(unit=unit, works=tuple(self.exchange.start(store.resident_tile(unit), ranges)))

    def settle_done(self, store: Store, pending: Gathering | None, version: int) -> Gathering | None:
        """The unit published now if its gather has finished, not after the next unit's update."""
        if pending is None or not all(w.is_completed() for w in pending.works):
            return pending
        self.settle(store, pending, version)
        return None

    def settle(self, store: Store, pending: Gathering | None, version: int) -> None:
        if pending is not None:
            self.exchange.finish(pending.works)
            _publish_unit(store, pending.unit, version)

    def grad_norm(self, store: Store, summed: float) -> float:
        return math.sqrt(summed)  # the units' totals, each all-reduced before the unit was touched


def update_clipped(
    store: Store,
    link: Link,
    step: int,
    saving: bool,
    max_grad_norm: float,
    update: PieceUpdate,
    speculate: bool = False,
) -> Applied:
    """Step `step` with global-norm clipping: this host's pieces, with the norm of every host's, batch by batch
    in forward order; each batch handed on (published, or its gather started) right after its update.
    `saving`: the checkpoint of the state after `step` steps is being written; each piece waits until the
    writer has it. A non-finite norm (the same on every host) skips the step whole on every host.
    `speculate`: update the units with a spare slot while their gradients land (speculate); those the step keeps
    are not updated again."""
    spec, version = store.spec, step + 1
    spans: list[tuple[int, float, float]] = []
    speculated = speculate_landing(store, step, max_grad_norm, update, spans) if speculate else ()
    if not speculate:
        wait_all_grads(store, step)
    (total,) = link.totals(float(store.sqnorms[[it.piece for it in spec.update_items]].sum()))
    norm = math.sqrt(total)
    finite, scale, pending = math.isfinite(norm), clip_scale(norm, max_grad_norm), None
    kept = frozenset(speculated) if finite and scale == 1.0 else frozenset()
    store.publish_verdict(step, norm, scale)  # the executor updates the units its device holds with it
    # the next forward follows right behind; the units the executors hold are theirs to update and hand on
    cpu_order = [unit for unit in spec.forward_order if unit not in spec.on_gpu]
    for unit, items in link.batches(spec.cpu_items, cpu_order):
        pending = link.settle_done(store, pending, version)
        if unit in kept:
            _keep_speculated(store, unit, items, step, saving)
        for item in () if unit in kept else items:
            start = time.time()
            _clipped_piece(store, item, step, saving, finite, scale, update)
            spans.append((item.unit, start, time.time()))
        now = link.hand_off(store, unit, items, version, changed=finite)
        link.settle(store, pending, version)
        pending = now
    link.settle(store, pending, version)
    return Applied(
        grad_norm=norm,
        clip_scale=scale,
        skipped=not finite,
        unit_spans=tuple(spans),
        speculated=len(speculated),
        committed=len(kept),
    )


def speculate_landing(
    store: Store, step: int, max_grad_norm: float, update: PieceUpdate, spans: list[tuple[int, float, float]]
) -> tuple[int, ...]:
    """wait_all_grads, and meanwhile each unit with a spare slot updated into it at clip scale 1 once all its
    pieces have landed (they land in the gradient order, one grads_ready each), whenever no landing waits to be
    taken; none after the squared norms landed so far clip the step (they only grow), nor once every gradient
    is in (the rest are updated after the norm, as without slots). The units speculated, in order."""
    spec = store.spec
    landing = [it for items in spec.emit_items for it in items]  # this host's pieces
    left = {unit: len(spec.pieces_of(unit)) for unit in spec.spare_units if spec.pieces_of(unit)}
    ready: deque[int] = deque()
    done: list[int] = []
    total, calm = 0.0, True
    for k, item in enumerate(landing):
        landed = False
        while calm and ready and not landed:
            landed = store.poll(GRADS_READY)
            if not landed:  # nothing has landed meanwhile: speculate
                done.append(_speculate_unit(store, ready.popleft(), update, spans))
        if not landed:
            store.wait(GRADS_READY, f"the gradients of step {step} ({k} of {len(landing)} pieces arrived)")
        total += float(store.sqnorms[item.piece])
        calm = calm and clip_scale(math.sqrt(total), max_grad_norm) == 1.0  # False for a NaN too
        if item.unit in left:
            left[item.unit] -= 1
            if not left[item.unit]:
                ready.append(item.unit)
    return tuple(done)


def _speculate_unit(store: Store, unit: int, update: PieceUpdate, spans: list[tuple[int, float, float]]) -> int:
    """The unit's update at clip scale 1 into its spare slot, this host's pieces one by one (its gradient in its
    resident tile)."""
    grads = store.grad_tile(unit)
    for piece, lo, hi in store.spec.pieces_of(unit):
        start = time.time()
        update(Item(unit, lo, hi, -1, piece), grads[lo:hi], 1.0, True)
        spans.append((unit, start, time.time()))
    return unit


def _keep_speculated(store: Store, unit: int, items: list[Item], step: int, saving: bool) -> None:
    """A speculated unit whose slot the step keeps: turned to at this host's first piece of it (one host: a batch
    is one piece; several: this host's slice), once the checkpoint writer has all of this host's."""
    pieces = store.spec.pieces_of(unit)
    if not items or items[0].piece != pieces[0][0]:
        return
    for piece, lo, hi in pieces if saving else ():
        wait_taken(store, Item(unit, lo, hi, -1, piece), step)
    store.turn_bank(unit)


def _clipped_piece(
    store: Store, item: Item, step: int, saving: bool, finite: bool, scale: float, update: PieceUpdate
) -> None:
    """One piece of a step with clipping, once the global norm is known (its version is the caller's)."""
    grads = store.grad_tile(item.unit)
    if saving:
        wait_taken(store, item, step)
    if finite:  # else the step is skipped whole: no piece has been touched
        update(item, grads[item.lo : item.hi], scale, False)
    elif store.spec.grads_in_resident:  # the tile holds the gradient: the weights back, unchanged
        store.refresh_resident(item.unit, item.lo, item.hi)


def update_unclipped(
    store: Store, link: Link, events: list[Any] | None, step: int, saving: bool, update: PieceUpdate
) -> Applied:
    """Step `step` without clipping: batch by batch in the gradient's order, as the batch's gradients arrive.
    Before a batch is touched the hosts add up how many of its pieces are non-finite: an inf or NaN on any
    host stops every host at the same unit (the batches before it updated and handed on; none is published
    for it, so nothing reads the half-applied step). A step cannot be skipped whole."""
    spec, version, summed, spans, pending = store.spec, step + 1, 0.0, [], None
    direct = spec.grads_in_resident  # the executor wrote the piece and its squared norm
    for unit, items in link.batches(spec.update_items, spec.grad_order):
        if unit in spec.on_gpu:  # the executor updates it once the step's norm is known: only counted here
            summed += _counted(store, link, items, step, unit)
            continue
        grads = [_arrived(store, item, step) if direct else take_grad(store, events, item, step) for item in items]
        start = time.time()
        for item in items if saving else ():
            wait_taken(store, item, step)
        if not direct:
            for item, grad in zip(items, grads, strict=True):
                store.sqnorms[item.piece] = sqnorm(grad)
        sq = [float(store.sqnorms[item.piece]) for item in items]
        finite = [x for x in sq if math.isfinite(x)]
        bad, part = link.totals(len(sq) - len(finite), math.fsum(finite))
        if bad:
            link.settle(store, pending, version)
            raise NonFiniteGradient(_non_finite(store, step, unit))
        summed += part
        pending = link.settle_done(store, pending, version)
        for item, grad in zip(items, grads, strict=True):
            update(item, grad, 1.0, False)
            spans.append((item.unit, start, start := time.time()))
        now = link.hand_off(store, unit, items, version, changed=True)
        for item in () if direct else items:
            free_grad(store, item)
        link.settle(store, pending, version)
        pending = now
    link.settle(store, pending, version)
    norm = link.grad_norm(store, summed)
    store.publish_verdict(step, norm, 1.0)
    return Applied(grad_norm=norm, clip_scale=1.0, skipped=False, unit_spans=tuple(spans))


def _counted(store: Store, link: Link, items: list[Item], step: int, unit: int) -> float:
    """Without clipping, a unit the executor updates on its device: its pieces' squared norms, once they are
    in ctl, summed (a non-finite one stops the run, as anywhere)."""
    for item in items:
        store.wait(GRADS_READY, f"the squared norm of unit {item.unit}'s gradient (step {step})")
    sq = [float(store.sqnorms[item.piece]) for item in items]
    finite = [x for x in sq if math.isfinite(x)]
    bad, part = link.totals(len(sq) - len(finite), math.fsum(finite))
    if bad:
        raise NonFiniteGradient(_non_finite(store, step, unit))
    return part


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
