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
