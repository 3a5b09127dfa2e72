"""A run over several hosts, at the store owner and the checkpoints: each host's owner fills its store from the
same init or pretrained weights (its slice of the fp32 params, the whole resident copy); each host's writer
writes its slices as its part of one checkpoint; a resume on the same host count restores each host's slices,
and one on another count (1 <-> H included) slices the checkpoint again, exactly. Real stores in one process,
a run id per host, every store unlinked on every path."""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.actors.checkpoint_writer import CheckpointWriter
from megatrain.actors.store_owner import StoreOwner
from megatrain.config.ipc import IpcConfig
from megatrain.errors import ConfigError, ProtocolError
from megatrain.formats import checkpoint as ckpt
from megatrain.ipc.messages import StoreRequest, WriteRequest
from megatrain.ipc.protocol import Store
from megatrain.ipc.shared.shm import host_run_id
from megatrain.launch.config.memplan import run_plan
from megatrain.launch.config.tree import Config
from megatrain.memory.machine import Machine
from megatrain.memory.plan import MemoryPlan
from megatrain.model.spec import ModelConfig, build_spec
from megatrain.step.engine import EngineConfig
from tests.harness import tiny_config_dict
from tests.model_fixtures import tiny_hf
from tests.shm_fixtures import leftovers, remove_all

# The embedding's tile is 4 blocks of the store's alignment: on 3 hosts, host 2 holds none of it.
INIT = ModelConfig(family="llama", hf=tiny_config_dict("llama", tied=False), init_seed=7)
IPC = IpcConfig(staging="resident", slab_params=2048)  # several pieces a unit: several checksums a file
ENGINE = EngineConfig(device="cpu", compute_dtype="bf16")
STEP = 3


def plan(model: ModelConfig, hosts: int, machine: Machine) -> MemoryPlan:
    """Each host's memory plan of the run over `hosts` hosts, as its driver makes it (in-process, periodic
    checkpoints: the writer runs)."""
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, batch_size=4 * hosts, seq_len=32),
        engine=ENGINE,
        ipc=IPC,
        train=dataclasses.replace(cfg.train, save_every=STEP),
        launch=dataclasses.replace(cfg.launch, runner="inprocess"),
    )
    return run_plan(cfg, build_spec(model), cuda=False, executors=1, machine=machine, hosts=hosts)


def request(
    run_id: str, model: ModelConfig, hosts: int, host: int, resume: Path | None, machine: Machine
) -> StoreRequest:
    return StoreRequest(
        run_id=run_id,
        model=model,
        no_decay_1d=True,
        clip=True,
        engine=ENGINE,
        num_packers=1,
        num_accumulators=1,
        ipc=IPC,
        batch_shape=(4, 32),
        resume=str(resume) if resume else None,
        hosts=hosts,
        host=host,
        memory=plan(model, hosts, machine),
    )


@contextmanager
def owners(hosts: int, model: ModelConfig = INIT, resume: Path | None = None) -> Iterator[list[StoreOwner]]:
    """Every host's store owner with its store made and filled; every store unlinked however the test ends."""
    rids = [host_run_id("test" + secrets.token_hex(4), h) for h in range(hosts)]
    made: list[StoreOwner] = []
    try:
        for h in range(hosts):
            made.append(StoreOwner())
            made[-1].create(request(rids[h], model, hosts, h, resume, made[-1].node_machine(IPC.shm_dir)))
        yield made
    finally:
        for owner in made:
            owner.shutdown()
        left = [name for r in rids for name in leftovers(r)]
        for r in rids:
            remove_all(r)
        assert not left, f"left in /dev/shm: {left}"


def stores(made: list[StoreOwner]) -> list[Store]:
    return [o.store for o in made]


def whole(hosts: list[Store], plane: str, unit: int) -> np.ndarray:
    """The unit's elements of an fp32 plane, the hosts' slices in host order."""
    return np.concatenate([st.tile(plane, unit) for st in hosts])


def assert_same(hosts: list[Store], want: dict[str, list[np.ndarray]]) -> None:
    """Every host's slices of every plane concatenate to `want`'s units, and every host's resident copy is the
    whole params cast (one host's cast of the same weights)."""
    for u in range(hosts[0].spec.num_units):
        for plane, units in want.items():
            assert np.array_equal(whole(hosts, plane, u), units[u]), f"{plane} of unit {u}"
        cast = torch.from_numpy(want["params"][u]).to(torch.bfloat16)
        for st in hosts:
            assert torch.equal(st.resident_tile(u), cast), f"host {st.spec.host}'s resident copy of unit {u}"


def planes_of(one: Store) -> dict[str, list[np.ndarray]]:
    return {p: [one.tile(p, u).copy() for u in range(one.spec.num_units)] for p in ckpt.PLANES}


@pytest.mark.parametrize("hosts", [2, 3])
def test_the_hosts_filled_from_a_fresh_init_are_one_host_s_store(hosts: int) -> None:
    with owners(1) as one, owners(hosts) as many:
        want = planes_of(one[0].store)
        assert want["params"][1].std() > 0  # a decoder layer really drawn
        assert_same(stores(many), {"params": want["params"]})
        assert [o.fill_report().source for o in many] == ["init"] * hosts
        if hosts == 3:
            assert many[2].store.tile("params", 0).size == 0  # the embedding is host 0's and host 1's


def test_the_hosts_filled_from_pretrained_weights_are_one_host_s_store(tmp_path: Path) -> None:
    tiny_hf("llama", tied=False, seed=3).save_pretrained(tmp_path / "m")
    model = ModelConfig(family="llama", pretrained=str(tmp_path / "m"))
    with owners(1, model) as one, owners(2, model) as two:
        want = planes_of(one[0].store)
        assert want["params"][1].std() > 0
        assert_same(stores(two), {"params": want["params"]})
        assert all(o.fill_report().bytes > 0 for o in two)


def moments(hosts: list[Store]) -> dict[str, list[np.ndarray]]:
    """Adam's moments as a step leaves them: each unit's drawn whole (the same on any host count), each host
    given its slice; the versions at STEP. The hosts' planes, whole per unit, are returned."""
    spec = hosts[0].spec
    for u in range(spec.num_units):
        rng = np.random.default_rng(u)
        for plane in ckpt.PLANES[1:]:
            drawn = rng.standard_normal(spec.layout.structure_of(u).numel).astype(np.float32)
            for st in hosts:
                lo, hi = st.spec.owned(u)
                st.tile(plane, u)[:] = drawn[lo:hi]
    for st in hosts:
        st.publish_versions(STEP)
    return {p: [whole(hosts, p, u) for u in range(spec.num_units)] for p in ckpt.PLANES}


def save(hosts: list[Store], root: Path) -> Path:
    """The checkpoint of STEP as the driver makes it: every host's writer writes and publishes its part, then
    one of them makes the step's directory of the parts."""
    writers = []
    try:
        for st in hosts:
            writers.append(CheckpointWriter(threads=2))
            writers[-1].store = Store.attach(st.spec, ckpt.PLANES)
        for w in writers:
            written = w.write(WriteRequest(step=STEP, root=str(root), meta={"config": ""}))
            assert written.bytes == 3 * 4 * w.store.spec.plane_elems
        for w in writers:
            w.publish(STEP)
        final = Path(writers[0].publish_hosts(STEP))
    finally:
        for w in writers:
            w.store.close()
    assert final == ckpt.step_dir(root, STEP) == ckpt.latest(root)
    assert not list(root.glob("*.tmp-*")), "a temporary directory left behind"
    return final


def test_two_hosts_write_one_checkpoint_that_resumes_on_two_one_and_three_hosts(tmp_path: Path) -> None:
    with owners(2) as two:
        want = moments(stores(two))
        directory = save(stores(two), tmp_path / "checkpoints")
    manifest = ckpt.manifest_of(directory)
    assert manifest["hosts"] == 2 and sorted(manifest["files"])[0] == "host-0/exp_avg.bin"
    part = ckpt.manifest_of(directory / "host-1")
    assert part["host"] == 1 and part["units"][0]["slice"] == [4096, 8192]
    assert ckpt.verify(directory) == ""
    for hosts in (2, 1, 3):
        with owners(hosts, resume=directory) as made:
            assert_same(stores(made), want)
            assert all((st.versions == STEP).all() for st in stores(made))
            assert all(o.fill_report().source == str(directory) for o in made)


def test_a_one_host_checkpoint_resumes_on_two_hosts(tmp_path: Path) -> None:
    with owners(1) as one:
        want = moments(stores(one))
        directory = save(stores(one), tmp_path / "checkpoints")
    assert ckpt.manifest_of(directory)["hosts"] == 1 and (directory / "host-0" / "params.bin").is_file()
    with owners(2, resume=directory) as two:
        assert_same(stores(two), want)


def test_a_corrupt_byte_in_one_host_s_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    with owners(2) as two:
        moments(stores(two))
        directory = save(stores(two), tmp_path / "checkpoints")
    bad = directory / "host-1" / "exp_avg.bin"
    first = ckpt.manifest_of(directory)["files"]["host-1/exp_avg.bin"]["segments"][0]
    raw = bytearray(bad.read_bytes())
    raw[first[0] + 5] ^= 0xFF
    bad.write_bytes(bytes(raw))
    assert f"{bad} is corrupt: bytes {first[0]}-{first[0] + first[1]} (unit " in ckpt.verify(directory)
    for hosts in (2, 3):  # read whole by its own host; read in slices by three
        with pytest.raises(ConfigError, match=f"train.resume: {bad} is corrupt"), owners(hosts, resume=directory):
            pass


def test_a_checkpoint_lacking_a_host_s_part_is_not_made(tmp_path: Path) -> None:
    """publish_hosts makes the step's directory only of every host's part of that step: with host 1's missing
    it is refused naming it, and `latest` still names the checkpoint before."""
    root = tmp_path / "checkpoints"
    with owners(2) as two:
        moments(stores(two))
        directory = save(stores(two), root)
    torn = ckpt.hosts_tmp(root, STEP + 1)
    torn.mkdir()
    shutil.copytree(directory / "host-0", torn / "host-0")  # of step STEP: not the part of STEP + 1
    with pytest.raises(ProtocolError, match=r"host-0 is not host 0's part"):
        ckpt.publish_hosts(root, STEP + 1, 2)
    manifest = torn / "host-0" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "step": STEP + 1}))  # now it is
    with pytest.raises(ProtocolError, match=r"host-1 is not host 1's part"):
        ckpt.publish_hosts(root, STEP + 1, 2)
    assert ckpt.latest(root) == directory and not ckpt.step_dir(root, STEP + 1).exists()
