"""Adam updater: the fused Numba AdamW, unit by unit, with global-norm clipping.

With clipping (optim.max_grad_norm > 0) it waits for every unit's gradient (in the fp32 grads plane or,
with a resident copy, in the unit's resident tile, in the compute dtype), computes the global norm,
then updates units in forward order, publishing each piece's version right after its update (over
several hosts, each unit's once its slices are gathered), so the next step's forward starts while later
units are still updated.
Without clipping there is no grads plane: it drains the gradient slabs itself, in the order the
backward produces them, and updates each unit while the GPU is still running the backward of the
units below it (12 bytes per parameter: params, m, v).
In resident mode it also rewrites the unit's compute-dtype copy right after the update, so the next
forward streams it with no packing step in between.
The waits, the order of the pieces and the versions are the protocol's (ipc/protocol/adam.py); this
actor supplies the arithmetic of one piece (_update) and takes its steps in order.
Over several hosts each host's updater updates its own slice of every unit; the updaters form a group of
their own (open_hosts, join_hosts) for the global norm and the gather of each unit's updated slices: the
protocol's link to the other hosts, which on one host is OneHost (nothing to sum or gather). The update is
the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import numpy as np
import torch

from megatrain import steptime
from megatrain.actors.base import Role, guarded
from megatrain.collective import Group, open_rendezvous
from megatrain.errors import ProtocolError, WaitTimeout
from megatrain.host.adamw import OptimConfig, adamw_update
from megatrain.host.hostops import warm_up
from megatrain.ipc.messages import AdamRequest, Applied
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.ipc.protocol.adam import HostsLink, Link, OneHost, update_clipped, update_unclipped
from megatrain.ipc.protocol.plan import Item
from megatrain.model.layout import STATE_PLANES
from megatrain.roster import ADAM

# Steps in a row that did not clip before a step speculates (ipc.spare_slots). A step that clips drops its
# slots, and its speculation cost only the host's memory bandwidth while the backward ran, which nothing else
# of the step takes then; the cut inside a step (the landed norms already clip) bounds it further. So the bar
# only keeps the updater from speculating through a phase where steps clip (the first steps, warm-up, a loss
# spike): one unclipped step between clipped ones is common where the norm hovers at max_grad_norm, two in a
# row seldom, and a third step's wait costs at most one step's gain.
SPECULATE_AFTER = 2


class AdamUpdater(Role):
    def __init__(self, cfg: OptimConfig):
        super().__init__(ADAM)
        self.cfg = cfg
        self.turn = threading.Condition()
        self.next_step = 0
        self.rendezvous = None  # host 0's, while the hosts' group forms
        self.link: Link | None = None  # to the other hosts: OneHost on one, HostsLink over several once joined
        self.calm = 0  # steps in a row that did not clip (SPECULATE_AFTER)
        warm_up()  # compiled (or loaded from Numba's cache) while the store is being made, not in a step
        a = np.zeros(4, np.float32)
        adamw_update(a, a.copy(), a.copy(), a.copy(), step=1, lr=0.0, cfg=cfg, weight_decay=0.0)
        adamw_update(
            a, a.copy(), a.copy(), a.copy(), step=1, lr=0.0, cfg=cfg, weight_decay=0.0, bf16_out=np.zeros(4, np.uint16)
        )
        bits = np.zeros(4, np.uint16)  # bf16 gradients in the resident copy (clipping)
        adamw_update(a, bits, a.copy(), a.copy(), step=1, lr=0.0, cfg=cfg, weight_decay=0.0, bf16_out=bits)
        spare = (a.copy(), a.copy(), a.copy())  # the speculative updates into spare slots (ipc.spare_slots)
        out = np.zeros(4, np.uint16)
        adamw_update(a, bits, a.copy(), a.copy(), step=1, lr=0.0, cfg=cfg, weight_decay=0.0, bf16_out=out, into=spare)
        adamw_update(a, a.copy(), a.copy(), a.copy(), step=1, lr=0.0, cfg=cfg, weight_decay=0.0, into=spare)
        self.mark("ready")

    def attach(self, spec: StoreSpec, start_step: int = 0) -> None:
        """`start_step`: the first step this updater will be called for (a resumed run's)."""
        self.next_step = start_step
        self.apply_threads(spec)  # Numba's for the update, torch's for the resident cast
        parts = spec.planes + (("resident",) if spec.resident else ()) + (() if spec.clip else ("staging",))
        parts += spec.spare_parts()  # its speculative updates' spare slots (ipc.spare_slots)
        self.store = Store.attach(spec, parts, role=self.name)
        self.link = OneHost() if spec.hosts == 1 else None
        self.mark("attached")

    def open_hosts(self, address: str) -> int:
        """Host 0's updater, after attach: the rendezvous of the hosts' updaters at `address` (this node's, as
        the other hosts reach it); returns its port."""
        spec = self._several_hosts()
        if spec.host != 0:
            raise ProtocolError(f"the hosts' rendezvous is host 0's updater's to open, not host {spec.host}'s")
        self.rendezvous = open_rendezvous(spec.hosts, spec.ipc.wait_timeout_s, host=address)
        return int(self.rendezvous.port)

    def join_hosts(self, address: str, port: int, bind: str | None = None) -> None:
        """Join the hosts' updaters' group (every host's updater at once: it returns when all have joined)
        through host 0's rendezvous at `address`:`port`; `bind`: this node's address as the other hosts reach
        it (for gloo's connections)."""
        spec = self._several_hosts()
        if spec.host == 0 and self.rendezvous is None:
            raise ProtocolError("host 0's updater joins the hosts' group through its own rendezvous: open_hosts first")
        where = self.rendezvous if spec.host == 0 else (address, port)
        group = Group(
            where,
            spec.host,
            spec.hosts,
            torch.device("cpu"),
            spec.ipc.wait_timeout_s,
            self.store.check_abort,
            parts=("stats",),
            bind=bind,
        )
        self.link = HostsLink.make(spec, group)

    def _several_hosts(self) -> StoreSpec:
        if self.store is None:
            raise ProtocolError("the Adam updater opens or joins the hosts' group after attach")
        spec = self.store.spec
        if spec.hosts == 1:
            raise ProtocolError("a run on one host has no hosts' group to open or join")
        return spec

    def memory_bandwidth(self) -> float:
        """This node's memory bandwidth with the updater's threads (bytes/s, megatrain/steptime.py): what its
        pass over every parameter runs at."""
        return steptime.memory_bytes_per_s(torch.get_num_threads())

    @guarded
    def step(self, request: AdamRequest) -> Applied:
        """With overlap the driver launches step t+1's call while step t's still runs (the actor is
        threaded): the data plane must still see the steps one after the other, in order."""
        step, lr, saving = request.step, request.lr, request.saving
        self._wait_turn(step)
        try:
            t0 = time.perf_counter()
            store, link, update = self.store, self._link(step), functools.partial(self._piece, step + 1, lr)
            if store.spec.clip:
                speculate = bool(store.spec.spares) and self.calm >= SPECULATE_AFTER
                out = update_clipped(store, link, step, saving, self.cfg.max_grad_norm, update, speculate)
                self.calm = self.calm + 1 if out.clip_scale == 1.0 and not out.skipped else 0
            else:
                out = update_unclipped(store, link, self.events, step, saving, update)
            return dataclasses.replace(out, adam_s=time.perf_counter() - t0)
        finally:
            with self.turn:
                self.next_step = step + 1
                self.turn.notify_all()

    def _link(self, step: int) -> Link:
        """The link to the other hosts' updaters: over several hosts, their group, joined before any step."""
        if self.link is None:
            spec = self.store.spec
            raise ProtocolError(
                f"Adam's step {step} over {spec.hosts} hosts needs the hosts' group: host {spec.host}'s updater "
                "has not joined it (AdamUpdater.join_hosts)"
            )
        return self.link

    def _wait_turn(self, step: int) -> None:
        ipc = self.store.spec.ipc
        deadline = time.monotonic() + ipc.wait_timeout_s
        with self.turn:
            while self.next_step != step:
                self.store.check_abort()
                if self.next_step > step:
                    raise ProtocolError(f"Adam step {step} requested after step {self.next_step - 1}")
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"waited {ipc.wait_timeout_s:g}s for Adam's step {self.next_step} to end before step {step}"
                    )
                self.turn.wait(ipc.poll_s)

    def _piece(self, t: int, lr: float, item: Item, grad: np.ndarray, scale: float, spare: bool) -> None:
        """The protocol's PieceUpdate: AdamW step `t` on the item's elements (`spare`: into its spare slot)."""
        self._update(item.unit, item.lo, item.hi, grad, t, lr, scale, spare)

    def _update(
        self, unit: int, lo: int, hi: int, g: np.ndarray, t: int, lr: float, scale: float, spare: bool = False
    ) -> None:
        """AdamW on elements [lo, hi) of the unit's tiles (g holds exactly those); `spare`: the new state into
        the unit's spare slot, its state and gradient left as they are."""
        store = self.store
        p, m, v = (store.span(part, unit, lo, hi) for part in STATE_PLANES)
        into = tuple(store.span(part, unit, lo, hi, spare=True) for part in STATE_PLANES) if spare else None
        split = min(max(store.spec.layout.structure_of(unit).decay_split() - lo, 0), hi - lo)
        fused = self._bf16_resident(unit, lo, hi, spare)  # the copy the next forward streams, in the same pass
        for sl, wd in ((slice(0, split), self.cfg.weight_decay), (slice(split, None), 0.0)):
            if p[sl].size:
                adamw_update(
                    p[sl],
                    g[sl],
                    m[sl],
                    v[sl],
                    step=t,
                    lr=lr,
                    cfg=self.cfg,
                    weight_decay=wd,
                    grad_scale=scale,
                    bf16_out=None if fused is None else fused[sl],
                    into=None if into is None else (into[0][sl], into[1][sl], into[2][sl]),
                )
        if store.spec.resident and fused is None:  # another compute dtype: cast right after the update
            store.refresh_resident(unit, lo, hi, spare)

    def _bf16_resident(self, unit: int, lo: int, hi: int, spare: bool = False) -> np.ndarray | None:
        """The unit's bf16 resident copy [lo, hi) as uint16 bits (`spare`: its spare slot's), for the fused
        update; None otherwise."""
        if not self.store.spec.resident or self.store.spec.staging_dtype != "bf16":
            return None
        return self.store.resident_tile(unit, spare)[lo:hi].view(torch.int16).numpy().view(np.uint16)
