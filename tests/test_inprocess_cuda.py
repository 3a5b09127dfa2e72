"""The in-process runner on a GPU (skipped without one; MEGATRAIN_TEST_CUDA=1 pytest -m cuda).

Every role is a thread of one process there, so the drainers get the executor's own gradient-slab
events (CUDA will not open an event handle in the process that made it), and one run's executor
follows another's: its pinned segments must be unregistered before their mappings go, or the next
run's segment, mapped at the same address, cannot be registered."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from megatrain.formats import checkpoint as ckpt
from tests.harness import NEEDS_CUDA, losses, planes
from tests.harness import train_tiny as run

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize(
    "extra",
    [["ipc.staging=slabs"], ["ipc.staging=resident", "optim.max_grad_norm=0"], ["ipc.staging=resident"]],
    ids=["slabs-clip", "resident-no-clip", "resident-clip"],
)
def test_runs_one_after_another_in_one_process_and_resume_bit_identical(tmp_path: Path, extra: list[str]) -> None:
    extra = ["engine.device=cuda", *extra]
    run(tmp_path / "a", "llama", *extra)
    gc.collect()  # the first executor and its mappings go before the second maps its segments
    a = tmp_path / "a" / "checkpoints"
    run(tmp_path / "b", "llama", *extra, f"train.resume={ckpt.step_dir(a, 5)}")
    assert planes(ckpt.step_dir(a, 10)) == planes(ckpt.step_dir(tmp_path / "b" / "checkpoints", 10))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(lb) == [6, 7, 8, 9, 10] and all(la[s] == lb[s] for s in lb)
