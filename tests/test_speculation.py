"""ipc.spare_slots: Adam's speculative updates into spare slots during the backward, kept where the step did not
clip. Nothing may change a bit: the kernel that writes a slot against the one that updates in place, whole runs
with and without slots (clipping on some steps and not others, with the GPU holding units too), checkpoints
written while slots are the state, and a resume without them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.config.optim import OptimConfig
from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.host.adamw import adamw_update
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.report.reporting import clipping_line
from megatrain.memory.host import GIB, auto_spares, resolve_spares, spare_bytes, spare_order, spare_room
from tests.harness import check, final_weights, losses, tiny_config, train_tiny
from tests.update_fixtures import UNITS, rows, run_held, same_run

# A threshold among the tiny llama's gradient norms (1.3 to 1.8) where the steps clip at first, then mostly do
# not, and one does after two that did not: speculation kept, and dropped once.
CLIPS_AT_FIRST = "optim.max_grad_norm=1.5"


@pytest.mark.parametrize("bf16_grad", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.61])
def test_the_update_into_a_slot_is_the_update_in_place_bit_for_bit(bf16_grad: bool, scale: float) -> None:
    rng = np.random.default_rng(7)
    n = 100_003
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 10.0 ** rng.integers(-12, 0, n)).astype(np.float32)
    g32 = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n)).astype(np.float32)
    g = torch.from_numpy(g32).bfloat16().view(torch.int16).numpy().view(np.uint16) if bf16_grad else g32
    cfg, kw = OptimConfig(betas=(0.9, 0.95), eps=1e-8), {"step": 4, "lr": 1e-3, "weight_decay": 0.1}
    before = [a.copy() for a in (p, m, v, g)]
    slot = tuple(np.full(n, np.nan, np.float32) for _ in range(3))
    slot_bits = np.zeros(n, np.uint16)
    adamw_update(p, g, m, v, cfg=cfg, grad_scale=scale, bf16_out=slot_bits, into=slot, **kw)
    for was, now in zip(before, (p, m, v, g), strict=True):
        assert np.array_equal(was.view(np.uint8), now.view(np.uint8)), "a speculative update changed its inputs"
    bits = np.zeros(n, np.uint16)
    adamw_update(p, g.copy(), m, v, cfg=cfg, grad_scale=scale, bf16_out=bits, **kw)
    for name, mine, want in zip(("params", "exp_avg", "exp_avg_sq"), slot, (p, m, v), strict=True):
        assert np.array_equal(mine.view(np.uint32), want.view(np.uint32)), name
    assert np.array_equal(slot_bits, bits)
    p0, m0, v0, g0 = before
    plain = tuple(np.zeros(n, np.float32) for _ in range(3))  # without the bf16 copy
    adamw_update(p0, g0, m0, v0, cfg=cfg, grad_scale=scale, into=plain, **kw)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(plain, (p, m, v), strict=True))


def _speculating(out: Path, *extra: str, steps: int = 20) -> Path:
    return run_held(out, 0, CLIPS_AT_FIRST, *extra, steps=steps)


def test_twenty_steps_are_bit_identical_with_and_without_spare_slots(tmp_path: Path) -> None:
    """Spare slots for every unit Adam updates (auto, on this host), for two, and none; with two units on the GPU
    and slots for the rest: every loss, weight and checkpoint alike. Checkpoints every 5 steps are written while
    speculated slots are the state of some units."""
    none = _speculating(tmp_path / "none", "ipc.spare_slots=0")
    every = _speculating(tmp_path / "auto")
    got = rows(every)
    assert all(r["speculated"] == 0 for r in rows(none))
    kept = [r for r in got if r["committed"]]
    dropped = [r for r in got if r["speculated"] and not r["committed"]]
    assert kept and dropped, [(r["clip_scale"], r["speculated"], r["committed"]) for r in got]
    assert all(r["clip_scale"] == 1.0 and r["committed"] == r["speculated"] for r in kept)
    assert all(r["clip_scale"] < 1.0 for r in dropped)
    assert max(r["speculated"] for r in got) == UNITS - 1  # every unit but the embedding, whose gradient is last
    same_run(none, every)
    same_run(none, _speculating(tmp_path / "two", "ipc.spare_slots=2"))
    held = run_held(tmp_path / "held", 2, CLIPS_AT_FIRST, "ipc.spare_slots=auto")
    assert max(r["speculated"] for r in rows(held)) == UNITS - 2
    same_run(none, held)
    line = clipping_line(got, 1.5)
    speculated, committed = sum(r["speculated"] for r in got), sum(r["committed"] for r in got)
    assert f"{speculated} unit updates speculated during the backward, {committed} of them kept" in line


@pytest.mark.parametrize("hosts", [2, 3])
def test_several_hosts_speculate_on_their_slices_bit_for_bit(tmp_path: Path, hosts: int) -> None:
    """Each host's Adam speculates on its own slices (three hosts: a host owns no piece of the smallest units)
    and every host keeps or drops its slots alike: losses, weights and every checkpoint's parts as without."""
    over = [f"actors.num_hosts={hosts}"]
    none = _speculating(tmp_path / "none", *over, "ipc.spare_slots=0")
    every = _speculating(tmp_path / "auto", *over)
    got = rows(every)
    assert any(r["committed"] for r in got), [(r["clip_scale"], r["speculated"], r["committed"]) for r in got]
    same_run(none, every)


def test_a_checkpoint_taken_with_slots_as_the_state_resumes_without_them_bit_for_bit(tmp_path: Path) -> None:
    whole = _speculating(tmp_path / "whole", "ipc.spare_slots=0", steps=16)
    first = _speculating(tmp_path / "first", steps=16)
    turned = [r["step"] for r in rows(first) if r["committed"]]
    assert any(step <= 15 for step in turned), turned
    resume = str(ckpt.step_dir(first / "checkpoints", 15))
    for spares in ("0", "auto"):
        again = _speculating(
            tmp_path / f"again-{spares}", f"ipc.spare_slots={spares}", f"train.resume={resume}", steps=16
        )
        assert {s: x for s, x in losses(again).items() if s > 15} == {s: x for s, x in losses(whole).items() if s > 15}
        for name, tensor in final_weights(whole).items():
            assert torch.equal(tensor, final_weights(again)[name]), (spares, name)


def test_spare_slots_a_run_cannot_have_are_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ipc.spare_slots 2: .*resident copy"):
        train_tiny(tmp_path / "slabs", "llama", "ipc.staging=slabs", "ipc.spare_slots=2", steps=1)
    with pytest.raises(ConfigError, match=r"ipc.spare_slots 1: .*clipping"):
        train_tiny(tmp_path / "noclip", "llama", "ipc.staging=resident", "optim.max_grad_norm=0", "ipc.spare_slots=1")
    with pytest.raises(ConfigError, match=rf"ipc.spare_slots {UNITS}: the model has {UNITS} units, 1 of them"):
        train_tiny(
            tmp_path / "many", "llama", "ipc.staging=resident", "engine.gpu_optimizer=1", f"ipc.spare_slots={UNITS}"
        )
    with pytest.raises(ConfigError, match=r"ipc.spare_slots must be 'auto' or an integer >= 0"):
        train_tiny(tmp_path / "neg", "llama", "ipc.spare_slots=-1", steps=1)


def test_auto_takes_the_units_whose_gradients_land_first_as_the_room_holds() -> None:
    from megatrain.model.spec import build_spec  # noqa: PLC0415

    layout = build_spec(tiny_config("llama", False, 1, "/tmp").model).layout
    order = spare_order(layout)
    assert order == (UNITS - 1, *range(UNITS - 2, 0, -1), 0)
    first_two = sum(spare_bytes(layout, u, 2) for u in order[:2]) + (1 << 20)
    assert auto_spares(layout, 0, first_two, 2) == 2
    assert auto_spares(layout, 0, first_two - 1, 2) == 1
    assert auto_spares(layout, 2, 1 << 40, 2) == UNITS - 2  # never a unit the GPU holds
    count, why = resolve_spares("auto", layout, 0, resident=False, clip=True, hosts=1, room=1 << 40, staging_bytes=2)
    assert count == 0 and "resident copy" in why
    count, _ = resolve_spares("auto", layout, 0, resident=True, clip=True, hosts=2, room=1 << 40, staging_bytes=2)
    assert count == UNITS
    # over several hosts a slot holds the host's slice of the fp32 state, beside the whole unit's resident copy
    assert all(spare_bytes(layout, u, 2, hosts=2) < spare_bytes(layout, u, 2) for u in order)
    # the headroom: 3 % of the node's RAM, at least 2 GiB, never below nothing
    assert spare_room(100 * GIB, 80 * GIB, 100 * GIB, 10 * GIB, 30 * GIB) == 47 * GIB
    assert spare_room(100 * GIB, 80 * GIB, 10 * GIB, 10 * GIB, 30 * GIB) == 48 * GIB
    assert spare_room(GIB, GIB, GIB, 2 * GIB, 2 * GIB) == 0


def test_speculative_updates_match_plain_pytorch_and_adamw(tmp_path: Path) -> None:
    """The reference test's run (tests/test_equivalence.py) with a threshold its steps cross both ways, so that
    some steps speculate and keep their slots: the same losses, norms and weights as HF + torch.optim.AdamW."""
    extra = ["ipc.staging=resident", "optim.max_grad_norm=1.6"]
    rep = compare(tiny_config("llama", False, 2, tmp_path, extra=extra), tmp_path)
    got = rep["summary"].metrics
    assert any(r["committed"] for r in got), [(r["clip_scale"], r["speculated"], r["committed"]) for r in got]
    assert any(r["clip_scale"] < 1.0 for r in got)
    check(rep, tied=False)
