"""Actor classes used directly (no Ray) on a real store."""

from __future__ import annotations

import threading
import time

from megatrain.actors.adam_updater import AdamUpdater
from megatrain.ipc.protocol import Store

from megatrain.adamw import OptimConfig
from tests.shm_fixtures import make_spec


def test_adam_takes_overlapping_step_calls_in_order(rid: str, model_spec) -> None:
    """With Adam overlap the driver has step t+1's call in flight while step t's runs; the later
    call must not touch the data plane first (it would take step t's gradients)."""
    spec = make_spec(rid, model_spec, staging="fp32")
    owner = Store.create(spec)
    try:
        adam = AdamUpdater(OptimConfig())
        adam.attach(spec)
        later: dict = {}
        thread = threading.Thread(target=lambda: later.update(adam.step(1, 1e-3)))
        thread.start()
        time.sleep(0.3)
        for _ in range(2 * spec.num_pieces):  # both steps' gradients have arrived
            owner.post("grads_ready")
        time.sleep(0.3)
        assert not later, "step 1 ran before step 0"
        first = adam.step(0, 1e-3)
        thread.join(30)
        assert later and list(owner.versions) == [2] * spec.num_pieces
        assert later["unit_spans"][0][1] >= first["unit_spans"][-1][2]
        adam.store.close()
    finally:
        owner.unlink()


def test_adam_writes_the_bf16_resident_copy_in_its_update(rid: str, model_spec) -> None:
    """Resident mode in bf16: right after each piece's update the copy the next forward streams equals
    torch's cast of the new fp32 params, bit for bit (the fused kernel, not a second pass)."""
    import dataclasses

    import numpy as np
    import torch

    spec = dataclasses.replace(make_spec(rid, model_spec, staging="bf16"), staging_mode="resident")
    owner = Store.create(spec)
    try:
        rng = np.random.default_rng(0)
        for u in range(spec.num_units):
            owner.tile("params", u)[:] = rng.standard_normal(owner.tile("params", u).size).astype(np.float32)
            owner.tile("grads", u)[:] = rng.standard_normal(owner.tile("grads", u).size).astype(np.float32)
        adam = AdamUpdater(OptimConfig(lr=1e-2))
        adam.attach(spec)
        for _ in range(spec.num_pieces):
            owner.post("grads_ready")
        adam.step(0, 1e-2)
        for u in range(spec.num_units):
            want = torch.from_numpy(owner.tile("params", u).copy()).to(torch.bfloat16)
            assert torch.equal(owner.resident_tile(u).view(torch.int16), want.view(torch.int16)), u
        adam.store.close()
    finally:
        owner.unlink()
