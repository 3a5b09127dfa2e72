"""engine.gpu_optimizer: the executor holds the optimizer of the first units and updates them itself. Nothing
may change a bit: the tensor update against the host's Numba kernel, whole runs with any number of units held
(clipping on some steps and not others, and without clipping), checkpoints and a resume on another count."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.config.optim import OptimConfig
from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.host.adamw import adamw_tensors, adamw_update
from megatrain.memory.gpu import auto_gpu_units, gpu_state_bytes, gpu_units_refusal
from tests.harness import LAYERS, final_weights, losses, planes, tiny_config, train_tiny

UNITS = LAYERS + 2  # the tiny models' units: embedding, layers, final norm and head


def _arrays(n: int, seed: int) -> tuple[np.ndarray, ...]:
    """Weights, moments and a gradient with the values that round differently if an operation is fused or
    reordered: zeros, tiny and large second moments, gradients of both signs across magnitudes."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 10.0 ** rng.integers(-12, 0, n)).astype(np.float32)
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n)).astype(np.float32)
    m[:7], v[:7], g[7:14] = 0, 0, 0
    return p, m, v, g


def update_both_ways(
    n: int, seed: int, scale: float, wd: float, grad_dtype: torch.dtype, device: str
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """One AdamW step on the same arrays by the host's kernel and by adamw_tensors on `device`: (p, m, v, bf16
    bits) of each, as numpy arrays."""
    cfg = OptimConfig(betas=(0.9, 0.95), eps=1e-8)
    p, m, v, g = _arrays(n, seed)
    grad = torch.from_numpy(g).to(grad_dtype)
    host_g = grad.view(torch.int16).numpy().view(np.uint16) if grad_dtype == torch.bfloat16 else g
    tp, tm, tv = (torch.from_numpy(a.copy()).to(device) for a in (p, m, v))
    bits = np.zeros(n, np.uint16)
    adamw_update(p, host_g.copy(), m, v, step=3, lr=1e-3, cfg=cfg, weight_decay=wd, grad_scale=scale, bf16_out=bits)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    args = {"step": 3, "lr": 1e-3, "cfg": cfg, "weight_decay": wd, "grad_scale": scale, "out": out}
    adamw_tensors(tp, grad.to(device), tm, tv, **args)
    mine = (*(t.cpu().numpy() for t in (tp, tm, tv)), out.cpu().view(torch.int16).numpy().view(np.uint16))
    return (p, m, v, bits), mine


def same_bits(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    for name, x, y in zip(("params", "exp_avg", "exp_avg_sq", "bf16 copy"), a, b, strict=True):
        bits = np.uint16 if x.dtype == np.uint16 else np.uint32
        differ = int((x.view(bits) != y.view(bits)).sum())
        assert differ == 0, f"{name}: {differ} of {x.size} elements differ"


@pytest.mark.parametrize("scale", [1.0, 0.2718281828])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_tensor_update_is_the_host_kernel_bit_for_bit(scale: float, wd: float, grad_dtype: torch.dtype) -> None:
    host, mine = update_both_ways(
        200_003, seed=int(scale * 10 + wd * 100), scale=scale, wd=wd, grad_dtype=grad_dtype, device="cpu"
    )
    same_bits(host, mine)


def _run(out: Path, held: int, *extra: str, steps: int = 20) -> Path:
    train_tiny(out, "llama", "ipc.staging=resident", f"engine.gpu_optimizer={held}", *extra, steps=steps)
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_run(a: Path, b: Path) -> None:
    assert losses(a) == losses(b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    steps = [s for s, _ in ckpt.complete(a / "checkpoints")]
    assert steps and steps == [s for s, _ in ckpt.complete(b / "checkpoints")]
    for step in steps:
        assert planes(ckpt.step_dir(a / "checkpoints", step)) == planes(ckpt.step_dir(b / "checkpoints", step)), step


# A threshold among the tiny llama's gradient norms of its 20 steps (1.3 to 1.8): some steps clip, some do not.
CLIPS_SOMETIMES = "optim.max_grad_norm=1.5"


def test_twenty_steps_are_bit_identical_with_any_number_of_units_on_the_device(tmp_path: Path) -> None:
    none = _run(tmp_path / "none", 0, CLIPS_SOMETIMES)
    scales = [r["clip_scale"] for r in _rows(none)]
    assert min(scales) < 1.0 and max(scales) == 1.0, f"the threshold must clip some steps and not others: {scales}"
    for held in (1, 3, UNITS):
        run = _run(tmp_path / f"held-{held}", held, CLIPS_SOMETIMES)
        assert [r["gpu_units"] for r in _rows(run)] == [held] * 20
        _same_run(none, run)


def test_without_clipping_every_unit_on_the_device_is_bit_identical(tmp_path: Path) -> None:
    none = _run(tmp_path / "none", 0, "optim.max_grad_norm=0", steps=10)
    _same_run(none, _run(tmp_path / "all", UNITS, "optim.max_grad_norm=0", steps=10))


def test_a_resume_on_another_count_continues_bit_for_bit(tmp_path: Path) -> None:
    """The checkpoint of step 5 written with every unit on the device, resumed with none and with two: each run
    the same as the one that never stopped."""
    whole = _run(tmp_path / "whole", 0, CLIPS_SOMETIMES, steps=10)
    first = _run(tmp_path / "first", UNITS, CLIPS_SOMETIMES, steps=10)
    resume = str(ckpt.step_dir(first / "checkpoints", 5))
    for held in (0, 2):
        again = _run(tmp_path / f"again-{held}", held, CLIPS_SOMETIMES, f"train.resume={resume}", steps=10)
        assert {s: x for s, x in losses(again).items() if s > 5} == {s: x for s, x in losses(whole).items() if s > 5}
        for name, tensor in final_weights(whole).items():
            assert torch.equal(tensor, final_weights(again)[name]), (held, name)


def test_the_count_a_run_cannot_hold_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine.gpu_optimizer 2: .*ipc.staging resident"):
        train_tiny(tmp_path / "slabs", "llama", "ipc.staging=slabs", "engine.gpu_optimizer=2", steps=1)
    with pytest.raises(ConfigError, match=rf"engine.gpu_optimizer {UNITS + 1}: the model has {UNITS} units"):
        train_tiny(tmp_path / "many", "llama", "ipc.staging=resident", f"engine.gpu_optimizer={UNITS + 1}", steps=1)
    assert "one executor on one host" in gpu_units_refusal(1, UNITS, True, executors=2, hosts=1)
    assert gpu_units_refusal(0, UNITS, False, executors=4, hosts=2) == ""


def test_auto_takes_the_most_units_from_the_first_that_fit() -> None:
    from megatrain.model.spec import build_spec  # noqa: PLC0415

    layout = build_spec(tiny_config("llama", False, 1, "/tmp").model).layout
    one, two = (gpu_state_bytes(layout, k, 2) for k in (1, 2))
    assert gpu_state_bytes(layout, 0, 2) == 0 < one < two
    assert auto_gpu_units(layout, one - 1, 2) == 0
    assert auto_gpu_units(layout, two, 2) == 2
    assert auto_gpu_units(layout, 1 << 40, 2) == UNITS
