"""Several executors on several GPUs (skipped with fewer than two; MEGATRAIN_TEST_CUDA=1 pytest -m cuda).

The in-process runner puts executor r on GPU r of one process; the gradients are summed through NCCL
from each executor's reducer stream. Each run is a fresh process, as a launch is. In fp32 compute 2
executors on the whole batch equal 1 executor to rounding; in bf16 they follow it closely."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.formats import checkpoint as ckpt
from tests.harness import NEEDS_CUDA, follows

pytestmark = [
    *NEEDS_CUDA,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_gpus_follow_one_on_the_whole_batch(tmp_path: Path, family: str, dtype: str, tol: float) -> None:
    base = ["engine.device=cuda", f"engine.compute_dtype={dtype}", "data.batch_size=4"]
    follows(tmp_path, family, base, "actors.num_gpus=2", tol)
    a = (ckpt.step_dir(tmp_path / "one" / "checkpoints", 10) / "host-0" / "params.bin").read_bytes()
    b = (ckpt.step_dir(tmp_path / "two" / "checkpoints", 10) / "host-0" / "params.bin").read_bytes()
    wa, wb = (torch.frombuffer(bytearray(x), dtype=torch.float32) for x in (a, b))
    assert (wa - wb).abs().max() <= tol * 10 * wa.abs().max(), "final weights"
