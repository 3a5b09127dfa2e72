"""Shared fixtures: one Ray instance for the in-process tests that use Ray, and leak checks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the whole session; the Trainer joins it instead of starting its own."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=96 * 2**20, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def run_leftovers(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"megatrain-{run_id}-" in n]
