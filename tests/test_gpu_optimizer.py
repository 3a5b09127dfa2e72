"""engine.gpu_optimizer: the executor holds the optimizer of the first units and updates them itself. Nothing
may change a bit: the tensor update against the host's Numba kernel, whole runs with any number of units held
(clipping on some steps and not others, and without clipping), checkpoints and a resume on another count."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.launch.report.reporting import clipped_fraction, clipping_line
from megatrain.memory.gpu import GPU_STATE_SCRATCH, auto_gpu_units, gpu_owners, gpu_state_bytes, gpu_units_refusal
from tests.harness import NO_AUTH, ROOT, SMALL, START_S, Cli, final_weights, losses, planes, tiny_config, train_tiny
from tests.update_fixtures import CLIPS_SOMETIMES, UNITS, rows, run_held, same_bits, same_run, update_both_ways


@pytest.mark.parametrize("scale", [1.0, 0.2718281828])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_tensor_update_is_the_host_kernel_bit_for_bit(scale: float, wd: float, grad_dtype: torch.dtype) -> None:
    host, mine = update_both_ways(
        200_003, seed=int(scale * 10 + wd * 100), scale=scale, wd=wd, grad_dtype=grad_dtype, device="cpu"
    )
    same_bits(host, mine)


def test_twenty_steps_are_bit_identical_with_any_number_of_units_on_the_device(tmp_path: Path) -> None:
    none = run_held(tmp_path / "none", 0, CLIPS_SOMETIMES)
    scales = [r["clip_scale"] for r in rows(none)]
    assert min(scales) < 1.0 and max(scales) == 1.0, f"the threshold must clip some steps and not others: {scales}"
    for held in (1, 3, UNITS):
        run = run_held(tmp_path / f"held-{held}", held, CLIPS_SOMETIMES)
        assert [r["gpu_units"] for r in rows(run)] == [held] * 20
        same_run(none, run)
    clipped = sum(s < 1.0 for s in scales)
    assert clipped_fraction(rows(run)) == clipped / 20
    assert clipping_line(rows(run), 1.5) == (
        f"clipping (optim.max_grad_norm 1.5): {clipped} of 20 steps clipped ({clipped / 20:.0%}); "
        f"the optimizer of {UNITS} units held and updated on the GPU (engine.gpu_optimizer)"
    )


def test_without_clipping_every_unit_on_the_device_is_bit_identical(tmp_path: Path) -> None:
    none = run_held(tmp_path / "none", 0, "optim.max_grad_norm=0", steps=10)
    same_run(none, run_held(tmp_path / "all", UNITS, "optim.max_grad_norm=0", steps=10))


def test_a_resume_on_another_count_continues_bit_for_bit(tmp_path: Path) -> None:
    """The checkpoint of step 5 written with every unit on the device, resumed with none and with two: each run
    the same as the one that never stopped."""
    whole = run_held(tmp_path / "whole", 0, CLIPS_SOMETIMES, steps=10)
    first = run_held(tmp_path / "first", UNITS, CLIPS_SOMETIMES, steps=10)
    resume = str(ckpt.step_dir(first / "checkpoints", 5))
    for held in (0, 2):
        again = run_held(tmp_path / f"again-{held}", held, CLIPS_SOMETIMES, f"train.resume={resume}", steps=10)
        assert {s: x for s, x in losses(again).items() if s > 5} == {s: x for s, x in losses(whole).items() if s > 5}
        for name, tensor in final_weights(whole).items():
            assert torch.equal(tensor, final_weights(again)[name]), (held, name)


def test_the_count_a_run_cannot_hold_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine.gpu_optimizer 2: .*ipc.staging resident"):
        train_tiny(tmp_path / "slabs", "llama", "ipc.staging=slabs", "engine.gpu_optimizer=2", steps=1)
    with pytest.raises(ConfigError, match=rf"engine.gpu_optimizer {UNITS + 1}: the model has {UNITS} units"):
        train_tiny(tmp_path / "many", "llama", "ipc.staging=resident", f"engine.gpu_optimizer={UNITS + 1}", steps=1)
    assert gpu_units_refusal(1, UNITS, True) == ""
    assert gpu_units_refusal(0, UNITS, False) == ""


def test_auto_takes_the_most_units_from_the_first_that_fit() -> None:
    from megatrain.model.spec import build_spec  # noqa: PLC0415

    layout = build_spec(tiny_config("llama", False, 1, "/tmp").model).layout
    one, two = (gpu_state_bytes(layout, k, 2) for k in (1, 2))
    assert gpu_state_bytes(layout, 0, 2) == 0 < one < two
    assert auto_gpu_units(layout, one - 1, 2) == 0
    assert auto_gpu_units(layout, two, 2) == 2
    assert auto_gpu_units(layout, 1 << 40, 2) == UNITS


def test_several_executors_share_the_units_evenly() -> None:
    from megatrain.model.spec import build_spec  # noqa: PLC0415

    layout = build_spec(tiny_config("llama", False, 1, "/tmp").model).layout
    numel = [layout.structure_of(u).numel for u in range(UNITS)]
    assert gpu_owners(layout, UNITS, 1) == dict.fromkeys(range(UNITS), 0)
    two = gpu_owners(layout, UNITS, 2)
    assert sorted(two) == list(range(UNITS)) and set(two.values()) == {0, 1}
    shares = [sum(n for u, n in enumerate(numel) if two[u] == r) for r in (0, 1)]
    assert abs(shares[0] - shares[1]) <= max(numel)  # as even as whole units go
    # the GPU holding most: its share's state and the other units' weights in the compute dtype
    want = max(16 * own + 2 * (sum(numel) - own) for own in shares) + GPU_STATE_SCRATCH
    assert gpu_state_bytes(layout, UNITS, 2, executors=2) == want < gpu_state_bytes(layout, UNITS, 2)


def test_over_several_hosts_each_gpu_holds_its_host_s_slice_of_the_state() -> None:
    from megatrain.memory.hosts import largest_slice  # noqa: PLC0415
    from megatrain.model.spec import build_spec  # noqa: PLC0415

    layout = build_spec(tiny_config("llama", False, 1, "/tmp").model).layout
    numel = [layout.structure_of(u).numel for u in range(UNITS)]
    first = [min(n, largest_slice(layout.units[u].tile, 2)) for u, n in enumerate(numel)]  # host 0's, the largest
    assert sum(first) < sum(numel)
    # bf16: the slice's fp32 weights, moments and bf16 gradient; every unit's bf16 weights whole
    want = 14 * sum(first) + 2 * sum(numel) + GPU_STATE_SCRATCH
    assert gpu_state_bytes(layout, UNITS, 2, hosts=2) == want < gpu_state_bytes(layout, UNITS, 2)
    # fp32: the engine reads the master weights themselves, so the slice adds its moments and gradient alone
    assert gpu_state_bytes(layout, UNITS, 4, hosts=2) == 12 * sum(first) + 4 * sum(numel) + GPU_STATE_SCRATCH


@pytest.mark.parametrize("gpus", [2, 3])
def test_several_executors_share_the_units_bit_for_bit(tmp_path: Path, gpus: int) -> None:
    """Executors sharing one store (the CPU device's) each hold and update their share of the units and send the
    others the new weights: 20 steps, clipping on some, with none, some and every unit held, alike."""
    over = [f"actors.num_gpus={gpus}", "data.batch_size=6"]
    none = run_held(tmp_path / "none", 0, CLIPS_SOMETIMES, *over)
    for held in (2, UNITS) if gpus == 2 else (UNITS,):
        got = run_held(tmp_path / f"held-{held}", held, CLIPS_SOMETIMES, *over)
        assert {r["gpu_units"] for r in rows(got)} == {held}, rows(got)
        same_run(none, got)


@pytest.mark.parametrize(("hosts", "gpus"), [(2, 1), (3, 1), (2, 2)])
def test_several_hosts_hold_their_slices_bit_for_bit(tmp_path: Path, hosts: int, gpus: int) -> None:
    """Over several hosts each host's executor holds its slice of the units' state (three hosts: a host owns no
    piece of the smallest units; two executors a host: each its share of the units), updates it from the
    hosts' sum, and sends it to every executor of the run: 20 steps, clipping on some, as with none held."""
    over = [f"actors.num_hosts={hosts}", f"actors.num_gpus={gpus}", f"data.batch_size={2 * gpus * hosts}"]
    none = run_held(tmp_path / "none", 0, CLIPS_SOMETIMES, *over)
    for held in (2, UNITS) if (hosts, gpus) == (2, 1) else (UNITS,):
        got = run_held(tmp_path / f"held-{held}", held, CLIPS_SOMETIMES, *over)
        assert {r["gpu_units"] for r in rows(got)} == {held}, rows(got)
        same_run(none, got)


@pytest.mark.parametrize("first_run", ["actors.num_hosts=2", "actors.num_gpus=2"])
def test_a_resume_on_another_count_of_hosts_or_gpus_continues_bit_for_bit(tmp_path: Path, first_run: str) -> None:
    """The checkpoint of step 5 written by two hosts holding every unit's slices, or by two executors sharing
    the units, resumed by one executor with two units held: the same as the one-executor run that never
    stopped."""
    whole = run_held(tmp_path / "whole", 0, CLIPS_SOMETIMES, "data.batch_size=4", steps=10)
    first = run_held(tmp_path / "first", UNITS, CLIPS_SOMETIMES, "data.batch_size=4", first_run, steps=10)
    resume = str(ckpt.step_dir(first / "checkpoints", 5))
    again = run_held(tmp_path / "again", 2, CLIPS_SOMETIMES, "data.batch_size=4", f"train.resume={resume}", steps=10)
    assert {s: x for s, x in losses(again).items() if s > 5} == {s: x for s, x in losses(whole).items() if s > 5}
    for name, tensor in final_weights(whole).items():
        assert torch.equal(tensor, final_weights(again)[name]), name


def _poison_step_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in layer 0's gradient (a unit the GPU holds when two or more are) in the second step."""
    from megatrain.actors.executor.streams import SyncSink  # noqa: PLC0415

    real, seen = SyncSink.emit, {"n": 0}

    def emit(self, unit: int, grad: torch.Tensor) -> None:  # noqa: ANN001
        if unit == 1:
            seen["n"] += 1
            if seen["n"] == 2:
                grad = grad.clone()
                grad[3] = math.nan
        real(self, unit, grad)

    monkeypatch.setattr(SyncSink, "emit", emit)


def test_a_non_finite_gradient_skips_the_step_whole_on_the_gpu_s_units_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_step_two(monkeypatch)
    none = run_held(tmp_path / "none", 0, steps=6)
    monkeypatch.undo()
    _poison_step_two(monkeypatch)  # the second run's own second step
    every = run_held(tmp_path / "all", UNITS, steps=6)
    assert [r["skipped"] for r in rows(every)] == [False, True, False, False, False, False]
    assert [r["gpu_units"] for r in rows(every)] == [UNITS, 0, UNITS, UNITS, UNITS, UNITS]
    same_run(none, every)


@pytest.mark.slow
def test_a_killed_executor_holding_the_optimizer_resumes_bit_for_bit_on_the_host_s(tmp_path: Path) -> None:
    """Through Ray, one process per actor: the executor holding the first units' optimizer SIGKILLed after the
    checkpoint of step 6, while the host's Adam keeps the rest's speculative updates in their spare slots (a
    threshold above the run's norms: no step clips). The run ends naming it, leaves nothing behind, and its
    resume with every update on the host and no slots ends where an uninterrupted run does: every loss,
    weight and moment."""
    from megatrain.launch.config.tree import load_config  # noqa: PLC0415
    from megatrain.launch.run.driver import Trainer  # noqa: PLC0415

    steps = 8
    common = ["ipc.staging=resident", "train.save_every=2", "ipc.stall_timeout_s=300", "optim.max_grad_norm=100"]
    plain = ["engine.gpu_optimizer=0", "ipc.spare_slots=0"]
    ref = tmp_path / "ref"
    overrides = [*SMALL, *common, f"train.steps={steps}", f"train.output_dir={ref}", "launch.runner=inprocess"]
    Trainer(load_config(ROOT / "examples/default.yaml", [*overrides, *plain])).run()
    cli = Cli(tmp_path / "run", *common, "engine.gpu_optimizer=2", "ipc.spare_slots=auto", steps=steps, env=NO_AUTH)
    pids = cli.actor_pids()
    cli.wait_for(r"checkpoint after step 6", timeout=START_S)
    cli.snapshot()
    os.kill(pids["gpu-executor"], signal.SIGKILL)
    rc, err = cli.finish(timeout=90), "".join(cli.stderr)
    assert rc == 1 and "died" in err and "actor 'gpu-executor'" in err, cli.text()
    cli.assert_clean()
    got = rows(cli.out)
    assert all(r["gpu_units"] == 2 for r in got) and any(r["committed"] for r in got), got
    again = Cli(tmp_path / "run", *common, *plain, steps=steps, env=NO_AUTH)
    assert again.finish(timeout=START_S) == 0, again.text()
    assert "resuming from" in "".join(again.stdout), again.text()
    assert losses(again.out) == losses(ref)
    mine, want = (ckpt.step_dir(d / "checkpoints", steps) for d in (again.out, ref))
    assert planes(mine) == planes(want)
    again.assert_clean()
