"""A fresh init drawn in parallel threads straight into the store is the init drawn unit by unit in order.

The store owner draws units in as many threads as the CPU plan gives it; each unit's draws go to its own
generator (model.UnitRng). These tests hold that to the plain scheme (the global generator seeded per
unit, the family's `_init_weights` on an allocated copy of the unit), bit for bit, and check the fallback
for an init that bypasses the unit's generator.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatrain.actors.store_owner import StoreOwner
from megatrain.ipc.cpus import Threads
from megatrain.ipc.protocol import Store
from megatrain.model.spec import _unit_modules, meta_model, unit_seed
from tests.model_fixtures import spec_for, tiny_hf
from tests.shm_fixtures import make_spec, owned


def plain_init(spec, unit: int, seed: int) -> torch.Tensor:
    """The unit's tile the way a single thread with the global generator draws it."""
    model = meta_model(spec.family, spec.hf_config)
    _, _, mods = _unit_modules(model)[unit]
    torch.manual_seed(unit_seed(seed, unit))
    tile = torch.zeros(spec.layout.structure_of(unit).numel)
    for sub, mod in mods.items():
        real = copy.deepcopy(mod).to_empty(device="cpu")
        for m in real.modules():
            model._init_weights(m)
        for name, p in real.named_parameters():
            slot = next(s for s in spec.layout.structure_of(unit).slots if s.name == sub + name)
            tile[slot.offset : slot.offset + slot.numel] = p.detach().reshape(-1)
    return tile


def owner_with_store(rid: str, spec, threads: int, resident: bool, family: str = "") -> StoreOwner:
    store_spec = make_spec(rid, spec, staging="bf16")
    store_spec = dataclasses.replace(
        store_spec, threads={"store-owner": Threads(threads, 1)}, staging_mode="resident" if resident else "slabs"
    )
    owner = StoreOwner("store-owner", family)
    owner.store = Store.create(store_spec)
    return owner


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False), ("mistral", False), ("qwen3", True)])
def test_parallel_draw_is_the_sequential_init(rid: str, family: str, tied: bool) -> None:
    spec = spec_for(tiny_hf(family, tied=tied, layers=4), family)
    owner = owner_with_store(rid, spec, threads=4, resident=True)
    with owned(owner.store) as store:
        before = torch.random.get_rng_state()
        owner._draw(seed=5)
        assert torch.equal(before, torch.random.get_rng_state()), "the parallel draw used the global generator"
        for u in range(len(spec.layout.units)):
            want = plain_init(spec, u, 5)
            assert torch.equal(store.torch_tile("params", u), want), f"unit {u}"
            assert torch.equal(store.resident_tile(u), want.to(torch.bfloat16)), f"resident copy of unit {u}"
        assert store.torch_tile("params", 1).std() > 0  # a decoder layer really drawn


def test_a_draw_whose_modeling_code_was_imported_ahead_is_the_same(rid: str) -> None:
    """The launcher spawns the owner with the family of a fresh init: it imports the modeling code on a thread
    from its start, and the draw waits for that import."""
    spec = spec_for(tiny_hf("qwen2", tied=False, layers=2), "qwen2")
    owner = owner_with_store(rid, spec, threads=2, resident=False, family="qwen2")
    with owned(owner.store) as store:
        owner._draw(seed=3)
        assert not owner.importing.is_alive() and "model code" in owner.marks
        for u in range(len(spec.layout.units)):
            assert torch.equal(store.torch_tile("params", u), plain_init(spec, u, 3)), f"unit {u}"


def test_a_run_that_may_resume_is_told_from_a_fresh_one(tmp_path) -> None:
    """A run that may resume reads its checkpoint before anything starts (launch/run/driver.py); only the others
    read their inputs beside the spawn, and have the init's modeling code imported ahead by the owner. A torn
    checkpoint is none to resume from."""
    import json

    from megatrain.formats import checkpoint as ckpt
    from megatrain.launch.prepare.resume import may_resume

    out = tmp_path / "out"
    assert not may_resume("auto", out) and not may_resume("none", out)
    assert may_resume(str(tmp_path / "elsewhere"), out)  # a named one is checked (refused if wrong) first
    step = ckpt.step_dir(out / "checkpoints", 5)
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": "torn"}))
    assert not may_resume("auto", out)
    (step / "manifest.json").write_text(json.dumps({"format": ckpt.FORMAT, "step": 5, "files": {}}))
    assert may_resume("auto", out) and not may_resume("none", out)


def test_an_init_that_bypasses_the_unit_generator_is_drawn_again_in_order(rid: str, monkeypatch, capsys) -> None:
    spec = spec_for(tiny_hf("llama", tied=False, layers=3), "llama")
    cls = type(meta_model(spec.family, spec.hf_config))
    plain = cls._init_weights

    def stray(self, module):  # a family drawing from the global generator by name
        plain(self, module)
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(generator=torch.default_generator)

    monkeypatch.setattr(cls, "_init_weights", stray)
    tiles = []
    for threads in (1, 3):
        owner = owner_with_store(f"{rid}{threads}", spec, threads=threads, resident=False)
        with owned(owner.store) as store:
            owner._draw(seed=2)
            tiles.append(store.plane("params").copy())
        assert "drawing again in unit order" in capsys.readouterr().out
    assert (tiles[0] == tiles[1]).all(), "the result depends on the thread count"
    assert (tiles[0] != 0).any()
