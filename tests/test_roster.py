"""The roster (megatrain/roster.py): for representative runs, its roles, their Ray resources and their threads,
against the numbers the placement and the CPU plan gave before the roster existed, written out here by hand;
and the staging mode is decided before any worker is spawned, so none is spawned and then ended."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatrain.ipc.cpus import ThreadRequest, Threads, cpu_plan
from megatrain.launch.config.tree import Config
from megatrain.launch.control.placement import ActorsConfig, bundle, demands, local_cpus, roster_for
from megatrain.launch.run import startup
from megatrain.memory.machine import Machine
from megatrain.memory.plan import staging_by_rule
from megatrain.roster import Kind, Verb, build_roster, parse_role, role_name, slot_names


def make(executors=1, packers=1, accs=1, cuda=True, clip=True, writer=False, staging="slabs"):
    actors = ActorsConfig(num_packers=packers, num_accumulators=accs)
    return roster_for(actors, cuda=cuda, clip=clip, writer=writer, staging=staging, executors=executors)


def resources(roster) -> dict[str, tuple[float, float]]:
    return {n: (d.cpus, d.gpus) for n, d in demands(roster).items()}


def test_one_gpu_slabs_with_clipping() -> None:
    roster = make(packers=2, accs=3, writer=True)
    assert resources(roster) == {
        "store-owner": (0.0, 0.0),
        "gpu-executor": (1.0, 0.97),  # three accumulators drain its slabs, 0.01 GPU each
        "adam-updater": (1.0, 0.0),
        "packer-0": (1.0, 0.0),
        "packer-1": (1.0, 0.0),
        "grad-accumulator-0": (1.0, 0.01),
        "grad-accumulator-1": (1.0, 0.01),
        "grad-accumulator-2": (1.0, 0.01),
        "checkpoint-writer": (0.0, 0.0),
    }
    assert bundle(demands(roster)) == {"CPU": 7.0, "GPU": 1.0}
    assert roster.drainers() == ["grad-accumulator-0", "grad-accumulator-1", "grad-accumulator-2"]
    assert roster.stepping(Verb.STREAM) == ["packer-0", "packer-1", "grad-accumulator-0", "grad-accumulator-1",
                                            "grad-accumulator-2"]  # fmt: skip
    assert cpu_plan(16, roster) == {
        "store-owner": Threads(16, 16),
        "gpu-executor": Threads(2, 1),
        "adam-updater": Threads(16, 16),
        "packer-0": Threads(4, 1),  # half the cores, split between the packers
        "packer-1": Threads(4, 1),
        "grad-accumulator-0": Threads(1, 5),  # the cores split between the accumulators
        "grad-accumulator-1": Threads(1, 5),
        "grad-accumulator-2": Threads(1, 5),
        "checkpoint-writer": Threads(1, 1),
    }


def test_one_gpu_resident_runs_no_packer_or_accumulator() -> None:
    roster = make(packers=2, accs=2, clip=True, staging="resident")
    assert resources(roster) == {
        "store-owner": (0.0, 0.0),
        "gpu-executor": (1.0, 1.0),  # the gradients wait in the resident copy: nobody drains slabs
        "adam-updater": (1.0, 0.0),
    }
    assert roster.drainers() == [] and roster.stepping(Verb.STREAM) == []
    assert roster["checkpoint-writer"].on_demand  # no periodic checkpoints: spawned at a graceful stop only
    assert set(cpu_plan(8, roster)) == {"store-owner", "gpu-executor", "adam-updater", "checkpoint-writer"}


def test_no_clipping_adam_drains_the_slabs() -> None:
    roster = make(accs=2, clip=False)
    assert resources(roster) == {
        "store-owner": (0.0, 0.0),
        "gpu-executor": (1.0, 0.99),
        "adam-updater": (1.0, 0.01),
        "packer-0": (1.0, 0.0),
    }
    assert roster.drainers() == ["adam-updater"]
    resident = make(clip=False, staging="resident")  # the old placement's sliver for Adam stays, unused
    assert resources(resident)["adam-updater"] == (1.0, 0.01) and resident.drainers() == []


def test_several_gpus_share_the_resident_copy() -> None:
    roster = make(executors=4, packers=3, accs=3, staging="resident")
    assert resources(roster) == {
        "store-owner": (0.0, 0.0),
        "gpu-executor": (1.0, 1.0),
        "gpu-executor-1": (1.0, 1.0),
        "gpu-executor-2": (1.0, 1.0),
        "gpu-executor-3": (1.0, 1.0),
        "adam-updater": (1.0, 0.0),
    }
    assert [r.index for r in roster.of(Kind.EXECUTOR)] == [0, 1, 2, 3]
    plan = cpu_plan(32, roster, ThreadRequest(adam=12))
    assert plan["gpu-executor-3"] == Threads(2, 1) and plan["adam-updater"] == Threads(12, 12)
    with pytest.raises(ValueError, match="resident"):
        make(executors=2, staging="slabs")


def test_cpu_device_executors_split_the_cores() -> None:
    roster = make(executors=2, cuda=False, staging="resident", writer=True)
    assert all(gpus == 0.0 for _, gpus in resources(roster).values())
    plan = cpu_plan(12, roster, numba_max=4)
    assert plan["gpu-executor"] == plan["gpu-executor-1"] == Threads(6, 4)  # Numba capped at its pool
    one = cpu_plan(12, make(cuda=False, packers=3))
    assert one["gpu-executor"] == Threads(12, 12) and one["packer-2"] == Threads(2, 1)
    assert cpu_plan(12, make(cuda=False), ThreadRequest(executor=3, packer=5, accumulator=7))["packer-0"] == Threads(
        5, 1
    )


def test_local_ray_gets_the_cpus_of_every_worker_kind() -> None:
    assert local_cpus(ActorsConfig(num_packers=3, num_accumulators=2)) == 7.0  # executor, Adam, 3 + 2


def test_the_staging_mode_is_decided_before_spawning() -> None:
    assert staging_by_rule("auto", cuda=False, clip=True) == "slabs"
    assert staging_by_rule("auto", cuda=True, clip=True) == "resident"
    assert staging_by_rule("auto", cuda=True, clip=False) is None  # the memory decides
    assert staging_by_rule("auto", cuda=True, clip=False, executors=2) == "resident"
    assert staging_by_rule("slabs", cuda=True, clip=True) == "slabs"
    with pytest.raises(ValueError, match="needs the resident copy"):
        staging_by_rule("slabs", cuda=True, clip=True, executors=2)
    with pytest.raises(ValueError, match="resolved staging mode"):
        build_roster(executors=1, packers=1, accumulators=1, cuda=True, clip=True, writer=False, staging="auto")


def test_names_round_trip_and_the_slots_keep_their_order() -> None:
    for kind in Kind:
        for i in range(1 if kind in (Kind.OWNER, Kind.ADAM, Kind.WRITER) else 3):
            assert parse_role(role_name(kind, i)) == (kind, i)
    for bad in ("packer", "gpu-executor-x", "adam-updater-1", "grad-accumulator-"):
        with pytest.raises(ValueError, match="is not an actor"):
            parse_role(bad)
    assert slot_names(executors=2, packers=2, accumulators=1) == [
        "gpu-executor", "gpu-executor-1", "adam-updater", "packer-0", "packer-1", "grad-accumulator-0",
        "checkpoint-writer",
    ]  # fmt: skip


class FakeCrew:
    """Records what is spawned and ended; the owner answers the node's memory."""

    def __init__(self, gpus: int, space: int):
        self.spawned: list[str] = []
        self.dropped: list[str] = []
        self.space, self.gpus = space, gpus
        self.roster = None
        self.runner = SimpleNamespace(
            connect=lambda cpus: None,
            has_gpu=lambda: gpus > 0,
            gpus=lambda: gpus,
            place=lambda b, need, hosts: None,
            nodes=lambda: 1,
        )

    def span(self, hosts: int) -> None:
        assert not self.spawned, "told its hosts after a spawn"

    def staff(self, roster) -> None:
        self.roster = roster

    def spawn(self, name, cls, args, demand) -> None:
        self.spawned.append(name)

    def drop(self, name) -> None:
        self.dropped.append(name)

    def call_one(self, name, method, *args):
        assert name == "store-owner" and method.__name__ == "node_machine"
        free = self.space
        return Machine(ram=free, total=free, shm=free, threshold=None)


class Inputs:
    here = True

    def __init__(self, model):
        self.model = model

    def failed(self) -> bool:
        return False

    def result(self):
        return self


@pytest.mark.parametrize("free, staging", [(1 << 50, "resident"), (1 << 20, "slabs")])
def test_the_memory_decides_before_the_workers_spawn(free: int, staging: str, model_spec, monkeypatch) -> None:
    """auto on CUDA without clipping: resident where the copy fits the owner's node, else slabs; the packers are
    spawned with the others or not at all, and nothing is ended."""
    monkeypatch.setattr(startup, "pretrained_config", lambda m: ("llama", None))
    cfg = Config()
    cfg.engine.device, cfg.optim.max_grad_norm, cfg.actors.num_packers = "cuda", 0.0, 2
    crew = FakeCrew(gpus=1, space=free)
    s = startup.spawn_actors(crew, cfg, Inputs(model_spec), startup.Phases())
    assert s.roster.staging == staging and crew.roster is s.roster and not crew.dropped
    packers = ["packer-0", "packer-1"] if staging == "slabs" else []
    assert crew.spawned == ["store-owner", "gpu-executor", "adam-updater", *packers]


@pytest.mark.parametrize("device, staging", [("cpu", "slabs"), ("cuda", "resident")])
def test_the_rules_decide_without_asking_the_owner(device: str, staging: str, monkeypatch) -> None:
    monkeypatch.setattr(startup, "pretrained_config", lambda m: ("llama", None))
    cfg = Config()
    cfg.engine.device, cfg.train.save_every = device, 5
    crew = FakeCrew(gpus=1 if device == "cuda" else 0, space=0)
    crew.call_one = None  # the owner is not asked
    s = startup.spawn_actors(crew, cfg, Inputs(None), startup.Phases())
    assert s.roster.staging == staging and not crew.dropped
    workers = ["packer-0", "grad-accumulator-0"] if staging == "slabs" else []
    assert crew.spawned == ["store-owner", "gpu-executor", "adam-updater", *workers, "checkpoint-writer"]
