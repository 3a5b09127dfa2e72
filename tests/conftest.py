"""Shared fixtures: one Ray instance for the in-process tests that use Ray, and leak checks."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# CPU-first, on any machine: the numerical tests hold the CPU's fp32 to 1e-5 against plain PyTorch, which
# bf16 on a GPU cannot, so the suite hides GPUs from itself and from every process it starts (set before
# anything initializes CUDA). The GPU tests (marked cuda) run with: MEGATRAIN_TEST_CUDA=1 pytest -m cuda
if os.environ.get("MEGATRAIN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the whole session; the Trainer joins it instead of starting its own."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=96 * 2**20, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def run_leftovers(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"megatrain-{run_id}-" in n]


@pytest.fixture
def rid():
    """A fresh run id; fails the test if anything of that run is left in /dev/shm."""
    from tests.shm_fixtures import leftovers, remove_all

    run_id = "test" + secrets.token_hex(4)
    try:
        yield run_id
    finally:
        left = leftovers(run_id)
        remove_all(run_id)
        assert not left, f"test left {left} in /dev/shm"


@pytest.fixture(scope="module")
def model_spec():
    from tests.helpers import spec_for, tiny_hf

    return spec_for(tiny_hf("llama", tied=False, layers=3), "llama")
