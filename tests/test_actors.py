"""Actor classes used directly (no Ray) on a real store."""

from __future__ import annotations

import threading

from megatrain.actors.adam_updater import AdamUpdater
from megatrain.host.adamw import OptimConfig, adamw_update
from megatrain.ipc.messages import AdamRequest
from megatrain.ipc.protocol import Store
from tests.shm_fixtures import make_spec


class _Watched(threading.Condition):
    """The updater's turn condition, telling each time a call waits on it: the test knows the later call is
    blocked on its turn, rather than assuming it after a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


def test_adam_takes_overlapping_step_calls_in_order(rid: str, model_spec) -> None:
    """With Adam overlap the driver has step t+1's call in flight while step t's runs; the later
    call must not touch the data plane first (it would take step t's gradients)."""
    spec = make_spec(rid, model_spec, staging="fp32")
    owner = Store.create(spec)
    try:
        adam = AdamUpdater(OptimConfig())
        adam.attach(spec)
        adam.turn = turn = _Watched()
        later: list = []
        thread = threading.Thread(target=lambda: later.append(adam.step(AdamRequest(step=1, lr=1e-3))))
        thread.start()
        assert turn.waited.wait(30), "step 1's call never waited for its turn"
        for _ in range(2 * spec.num_pieces):  # both steps' gradients have arrived
            owner.post("grads_ready")
        turn.waited.clear()
        assert turn.waited.wait(30)  # step 1 looked again with every gradient there, and still waits its turn
        assert not later, "step 1 ran before step 0"
        first = adam.step(AdamRequest(step=0, lr=1e-3))
        thread.join(30)
        assert later and list(owner.versions) == [2] * spec.num_pieces
        assert later[0].unit_spans[0][1] >= first.unit_spans[-1][2]
        adam.store.close()
    finally:
        owner.unlink()


def test_adam_takes_bf16_gradients_from_the_resident_copy_and_writes_the_new_weights_there(
    rid: str, model_spec
) -> None:
    """Clipping in resident mode (bf16): each unit's gradient waits in its resident tile; Adam's update is the
    one of the widened gradient, and right after it the tile holds torch's cast of the new fp32 params, bit
    for bit (the fused kernel, not a second pass)."""
    import dataclasses

    import numpy as np
    import torch

    spec = dataclasses.replace(make_spec(rid, model_spec, staging="bf16"), staging_mode="resident")
    owner = Store.create(spec)
    try:
        rng = np.random.default_rng(0)
        cfg, want = OptimConfig(lr=1e-2), {}
        for u in range(spec.num_units):
            p = owner.tile("params", u)
            p[:] = rng.standard_normal(p.size).astype(np.float32)
            grad = torch.from_numpy(rng.standard_normal(p.size).astype(np.float32)).to(torch.bfloat16)
            owner.resident_tile(u).copy_(grad)
            want[u] = p.copy()
            adamw_update(
                want[u],
                grad.float().numpy(),
                np.zeros_like(p),
                np.zeros_like(p),
                step=1,
                lr=1e-2,
                cfg=cfg,
                weight_decay=0.0,
            )
        adam = AdamUpdater(cfg)
        adam.attach(spec)
        for _ in range(spec.num_pieces):
            owner.post("grads_ready")  # squared norms left at 0: no clipping scale
        adam.step(AdamRequest(step=0, lr=1e-2))
        for u in range(spec.num_units):
            np.testing.assert_array_equal(owner.tile("params", u), want[u])
            cast = torch.from_numpy(want[u]).to(torch.bfloat16)
            assert torch.equal(owner.resident_tile(u).view(torch.int16), cast.view(torch.int16)), u
        adam.store.close()
    finally:
        owner.unlink()
