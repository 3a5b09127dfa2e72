"""Shared fixtures: one Ray instance for the in-process tests that use Ray, a simulated cluster of several nodes,
and leak checks. Helpers the tests share are in tests/harness.py."""

from __future__ import annotations

import fcntl
import gc
import os
import secrets
import subprocess
import sys
import tempfile
import time
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

# ---- under pytest-xdist (MEGATRAIN_TEST_WORKERS=N ./run-tests.sh) -----------------------------------
# Every run the suite starts sweeps /dev/shm of runs whose owner is dead (actors/store_owner.py), and so
# does `megatrain-launch --cleanup`. The tests marked shm_alone make such runs on purpose (a dead or reused
# owner pid, a segment without a control segment): a sweep from another worker would take them mid-test.
# They run on one worker, first, while no other test of the session runs (a lock over the workers).
ALONE = "shm_alone"


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker(ALONE) is not None


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _ray_token_before_workers()


def _ray_token_before_workers() -> None:
    """A local ray.init makes ~/.ray/auth_token where there is none. Two workers starting Ray at once on a
    fresh machine would each write a token of their own, and one instance's processes would read the
    other's: the controller makes it once, before the workers start."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or (Path.home() / ".ray" / "auth_token").exists():
        return
    subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )


# The two longest units start side by side, right after the shm_alone group: the module of Ray jobs (its tests
# share a Ray head; minutes in all) and then the chain of kills in test_lifecycle.py (minutes alone). In this
# order because a worker is handed its next unit while it has two tests or fewer left: the worker that takes
# the jobs' eight is not handed the chain too.
FIRST = ("test_jobs.py", "test_lifecycle.py::test_one_run_stopped_and_killed_mid_checkpoint_resumes_bit_identical")


def pytest_itemcollected(item: pytest.Item) -> None:
    """The units --dist loadgroup hands out: each module whole (its module-scoped fixtures are made once);
    but a test marked slow in a module not marked so is a unit of its own, and the shm_alone tests are one."""
    if not hasattr(item.config, "workerinput"):
        return
    if _alone(item):
        item.add_marker(pytest.mark.xdist_group(ALONE))
    elif item.get_closest_marker("slow") is None or item.getparent(pytest.Module).get_closest_marker("slow"):
        item.add_marker(pytest.mark.xdist_group(item.path.stem))


def _first(item: pytest.Item) -> int:
    """Where the item's unit goes: the shm_alone group, FIRST in order, the other slow tests, the rest."""
    if _alone(item):
        return 0
    name = item.nodeid.split("@")[0].removeprefix("tests/")
    for i, prefix in enumerate(FIRST):
        if name.startswith(prefix):
            return 1 + i
    return 1 + len(FIRST) + (item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, after pytest has ordered the tests by their fixtures: the units in _first's order, so
    that no test of minutes starts last (run-tests.sh keeps it with --no-loadscope-reorder)."""
    if hasattr(config, "workerinput"):
        items.sort(key=_first)


class _Turns:
    """A readers-writer lock over the workers (flock on files in the session's shared temp directory): an
    shm_alone test holds it exclusively, every other test shared. A waiting exclusive holder closes the gate,
    so that the other workers' next tests wait for it instead of keeping it out for good."""

    def __init__(self, root: Path, alone_tests: bool):
        self.gate = os.open(root / "megatrain-shm-gate", os.O_RDWR | os.O_CREAT, 0o600)
        self.turn = os.open(root / "megatrain-shm-turn", os.O_RDWR | os.O_CREAT, 0o600)
        self.started = root / "megatrain-shm-alone-started"
        self.alone = False
        # Workers start together: before its first test, a worker gives the one with the shm_alone group a
        # moment to take its turn, rather than making it wait for a test of minutes.
        self.wait_for_alone = alone_tests

    def take(self, alone: bool) -> None:
        if alone:
            if not self.alone:
                fcntl.flock(self.gate, fcntl.LOCK_EX)
                fcntl.flock(self.turn, fcntl.LOCK_EX)
                self.alone = True
                self.started.touch()
            return
        if self.wait_for_alone:
            self.wait_for_alone = False
            deadline = time.monotonic() + 30
            while not self.started.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        fcntl.flock(self.gate, fcntl.LOCK_SH)
        fcntl.flock(self.turn, fcntl.LOCK_SH)
        fcntl.flock(self.gate, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self.turn, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.alone = False


_turns: list[_Turns] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not hasattr(item.config, "workerinput"):
        return (yield)
    if not _turns:
        basetemp = item.config.option.basetemp  # xdist gives each worker one inside the controller's
        root = Path(basetemp).parent if basetemp else Path(tempfile.gettempdir())
        _turns.append(_Turns(root, any(_alone(it) for it in item.session.items)))
    turns, alone = _turns[0], _alone(item)
    turns.take(alone)
    try:
        return (yield)
    finally:
        if not (alone and nextitem is not None and _alone(nextitem)):
            turns.release()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the whole session; the Trainer joins it instead of starting its own."""
    import ray

    from megatrain.launch.control.cluster import LOCAL_SYSTEM_CONFIG  # as the launcher's own: no idle worker per CPU

    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=96 * 2**20,
        log_to_driver=False,
        _system_config=LOCAL_SYSTEM_CONFIG,
    )
    try:
        yield ray
    finally:
        # Handles and refs of the session's runs still held in garbage cycles (a traceback's frames) go while
        # their core worker exists, not at the interpreter's exit after it is gone.
        gc.collect()
        ray.shutdown()


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
    from tests.model_fixtures import spec_for, tiny_hf

    return spec_for(tiny_hf("llama", tied=False, layers=3), "llama")


@pytest.fixture(scope="module")
def cluster():
    """A cluster of several Ray nodes simulated on this machine (raylets of their own, ray.cluster_utils), started
    by this process, which never connects to them (the session's own Ray connection, where a fixture made one,
    stays as it is): every run joins them from a launcher process of its own."""
    from ray.cluster_utils import Cluster

    from tests.harness import NO_AUTH, NODE_CPUS, NODES

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ.update(NO_AUTH)  # for its nodes (the launchers get NO_AUTH in their environment)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            nodes.add_node(num_cpus=NODE_CPUS)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()  # its own raylets and head, by pid
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before
