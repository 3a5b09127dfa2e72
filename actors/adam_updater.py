"""Adam updater: global-norm clipping and the fused Numba AdamW, unit by unit in forward order.

In resident mode it also rewrites the unit's compute-dtype copy right after the update, so the next
forward streams it with no packing step in between.

Each unit's version counter is bumped right after its update, so packers for the next step start on
the embedding and first layers while later layers are still being updated.
"""

from __future__ import annotations

import math
import time

import numba
import torch
from megatrain.actors.base import Role, guarded
from megatrain.ipc.protocol import PLANES, Store, StoreSpec

from megatrain.adamw import OptimConfig, adamw_update, clip_scale


class AdamUpdater(Role):
    def __init__(self, spec: StoreSpec, cfg: OptimConfig, threads: int = 0):
        super().__init__("adam-updater")
        if threads > 0:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.store = Store.attach(spec, PLANES + (("resident",) if spec.resident else ()), role=self.name)

    @guarded
    def step(self, step: int, lr: float) -> dict:
        store = self.store
        units = store.spec.num_units
        for i in range(units):
            store.wait("grads_ready", f"gradients of step {step} ({i} of {units} units arrived)")
        t0 = time.perf_counter()
        norm = math.sqrt(float(store.sqnorms.sum()))
        finite = math.isfinite(norm)
        scale = clip_scale(norm, self.cfg.max_grad_norm)
        spans = []
        for unit in range(units):
            start = time.time()
            if finite:
                self._update(unit, step + 1, lr, scale)
                if store.spec.resident:  # the copy the next forward streams, cast (RNE) right after the update
                    store.resident_tile(unit).copy_(store.torch_tile("params", unit))
            store.versions[unit] = step + 1
            spans.append((unit, start, time.time()))
        return {"grad_norm": norm, "clip_scale": scale, "skipped": not finite, "adam_s": time.perf_counter() - t0,
                "unit_spans": spans}

    def _update(self, unit: int, t: int, lr: float, scale: float) -> None:
        store = self.store
        p, g, m, v = (store.tile(part, unit) for part in ("params", "grads", "exp_avg", "exp_avg_sq"))
        split = store.spec.layout.structure_of(unit).decay_split()
        for sl, wd in ((slice(0, split), self.cfg.weight_decay), (slice(split, None), 0.0)):
            if p[sl].size:
                adamw_update(p[sl], g[sl], m[sl], v[sl], step=t, lr=lr, cfg=self.cfg, weight_decay=wd,
                             grad_scale=scale)
