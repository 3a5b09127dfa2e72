"""Two hosts of one GPU each (skipped with fewer than two GPUs; MEGATRAIN_TEST_CUDA=1 pytest -m cuda).

The in-process runner simulates the hosts in one process, each executor on a GPU of its own: each unit's
gradient is reduce-scattered between the hosts through NCCL from each executor's reducer stream, each host's
Adam updates its slice and the slices are gathered into both hosts' copies. In fp32 compute two hosts on the
whole batch equal one GPU to rounding; in bf16 they follow it closely. Each run is a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import NEEDS_CUDA, follows

pytestmark = [*NEEDS_CUDA, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_hosts_follow_one_gpu_on_the_whole_batch(tmp_path: Path, family: str, dtype: str, tol: float) -> None:
    base = ["engine.device=cuda", f"engine.compute_dtype={dtype}", "data.batch_size=4", "train.save_final=true"]
    base += ["train.save_every=0", "ipc.staging=resident"]
    follows(tmp_path, family, base, "actors.num_hosts=2", tol)
    wa, wb = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("one", "two"))
    for name, a in wa.items():
        assert (a - wb[name]).abs().max() <= tol * 10 * a.abs().max(), name
