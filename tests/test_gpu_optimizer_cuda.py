"""engine.gpu_optimizer on a GPU (skipped without one; MEGATRAIN_TEST_CUDA=1 pytest -m cuda): the update on the
device is the host kernel's bit for bit, and a run whose optimizer the GPU holds whole (auto, on a model this
small) is the run with every update on the host, checkpoints included, and resumes on the host's; with two GPUs,
the units shared by two executors of one host, and sliced over two hosts."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from megatrain.formats import checkpoint as ckpt
from tests.harness import NEEDS_CUDA, final_weights, losses, train_tiny
from tests.update_fixtures import CLIPS_SOMETIMES, UNITS, rows, same_bits, same_run, update_both_ways

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize("scale", [1.0, 0.2718281828])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_update_is_the_host_kernel_bit_for_bit(scale: float, grad_dtype: torch.dtype) -> None:
    host, mine = update_both_ways(3_000_017, seed=7, scale=scale, wd=0.1, grad_dtype=grad_dtype, device="cuda")
    same_bits(host, mine)


def test_a_run_with_the_optimizer_on_the_gpu_is_the_host_s_bit_for_bit(tmp_path: Path) -> None:
    common = ("engine.device=cuda", "ipc.staging=resident", CLIPS_SOMETIMES)
    train_tiny(tmp_path / "host", "llama", *common, "engine.gpu_optimizer=0", steps=10)
    gc.collect()
    train_tiny(tmp_path / "gpu", "llama", *common, steps=10)  # auto: a model this small fits whole
    gc.collect()
    assert [r["gpu_units"] for r in rows(tmp_path / "gpu")] == [UNITS] * 10
    same_run(tmp_path / "host", tmp_path / "gpu")
    resume = f"train.resume={ckpt.step_dir(tmp_path / 'gpu' / 'checkpoints', 5)}"
    train_tiny(tmp_path / "again", "llama", *common, "engine.gpu_optimizer=0", resume, steps=10)
    assert {s: x for s, x in losses(tmp_path / "again").items()} == {
        s: x for s, x in losses(tmp_path / "host").items() if s > 5
    }
    for name, tensor in final_weights(tmp_path / "host").items():
        assert torch.equal(tensor, final_weights(tmp_path / "again")[name]), name


def test_a_run_with_speculative_updates_on_a_gpu_is_the_plain_host_s_bit_for_bit(tmp_path: Path) -> None:
    """ipc.spare_slots on CUDA: the gradients land through the streamed sink's copies, the next forward streams
    each unit's weights from whichever bank holds them (the spare slots' resident copy pinned as the resident's);
    two units on the GPU and slots for the rest, against every update on the host after the norm."""
    common = ("engine.device=cuda", "ipc.staging=resident", "optim.max_grad_norm=1.5")
    train_tiny(tmp_path / "plain", "llama", *common, "engine.gpu_optimizer=0", "ipc.spare_slots=0", steps=20)
    gc.collect()
    train_tiny(tmp_path / "both", "llama", *common, "engine.gpu_optimizer=2", "ipc.spare_slots=auto", steps=20)
    gc.collect()
    got = rows(tmp_path / "both")
    assert any(r["committed"] for r in got), [(r["clip_scale"], r["speculated"], r["committed"]) for r in got]
    same_run(tmp_path / "plain", tmp_path / "both")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_share_the_units_bit_for_bit(tmp_path: Path) -> None:
    """Two executors over one store: each holds and updates its share of the units (their summed gradient
    broadcast from executor 0 through NCCL) and sends the other the new weights; every unit held against none."""
    common = ("engine.device=cuda", "ipc.staging=resident", CLIPS_SOMETIMES, "actors.num_gpus=2")
    train_tiny(tmp_path / "host", "llama", *common, "engine.gpu_optimizer=0", steps=10)
    gc.collect()
    train_tiny(tmp_path / "gpus", "llama", *common, f"engine.gpu_optimizer={UNITS}", steps=10)
    gc.collect()
    assert [r["gpu_units"] for r in rows(tmp_path / "gpus")] == [UNITS] * 10
    same_run(tmp_path / "host", tmp_path / "gpus")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_hosts_hold_their_slices_bit_for_bit(tmp_path: Path) -> None:
    """Two hosts of one GPU each: each holds its slice of every unit's state, updates it from the hosts'
    reduce-scatter (NCCL) and sends it to the other host's executor; every unit held against none."""
    common = ("engine.device=cuda", "ipc.staging=resident", CLIPS_SOMETIMES, "actors.num_hosts=2")
    train_tiny(tmp_path / "host", "llama", *common, "engine.gpu_optimizer=0", "data.batch_size=4", steps=10)
    gc.collect()
    train_tiny(tmp_path / "gpus", "llama", *common, f"engine.gpu_optimizer={UNITS}", "data.batch_size=4", steps=10)
    gc.collect()
    assert [r["gpu_units"] for r in rows(tmp_path / "gpus")] == [UNITS] * 10
    same_run(tmp_path / "host", tmp_path / "gpus")
