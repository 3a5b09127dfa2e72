"""The store is made while the executor starts: the owner plans it with the engine's sizes still `auto`
(the fixed ones stand in) and settles the chosen sizes afterwards. The checkpoint plan they fix changes
the walk, not the segments; the staging mode is the memory plan's, decided once before the store, and
chosen sizes whose pinned checkpoints no longer leave room beside it are refused with the numbers.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from megatrain.actors.store_owner import StoreOwner
from megatrain.config.ipc import IpcConfig
from megatrain.errors import ResourceError
from megatrain.host import hostmem
from megatrain.ipc.messages import StoreRequest
from megatrain.ipc.protocol import Store, checkpoint_host_bytes, plan_store
from megatrain.ipc.shared import shm
from megatrain.ipc.shared.shm import HEADER_BYTES
from megatrain.launch.config.memplan import run_plan
from megatrain.launch.config.tree import Config
from megatrain.memory.machine import Machine
from megatrain.memory.plan import MemoryPlan
from megatrain.model.spec import ModelConfig, ModelSpec, build_spec
from megatrain.step.engine import EngineConfig, fixed_sizes
from tests.harness import TINY
from tests.shm_fixtures import leftovers

MODEL = ModelConfig(family="llama", hf={**TINY, "num_hidden_layers": 4, "vocab_size": 4096})
BATCH = (4, 256)  # one pinned checkpoint: 4 x 256 tokens x 32 hidden x 2 bytes
AUTO = EngineConfig(device="cuda", compute_dtype="bf16")  # K, last block, chunks still `auto`
CHOSEN = dataclasses.replace(
    AUTO, checkpoint_interval=1, last_block_layers=1, chunk_sequences=0, loss_chunk_tokens=2048
)  # 3 checkpoints where the fixed sizes keep 1


def run(ipc: IpcConfig, clip: bool) -> Config:
    """The run the owner is asked for a store of: MODEL, BATCH, the engine's sizes still `auto`, periodic
    checkpoints (the writer runs from the start), in-process (no launcher or Ray of its own beside the store)."""
    cfg = Config()
    return dataclasses.replace(
        cfg,
        model=MODEL,
        data=dataclasses.replace(cfg.data, batch_size=BATCH[0], seq_len=BATCH[1]),
        optim=dataclasses.replace(cfg.optim, max_grad_norm=cfg.optim.max_grad_norm if clip else 0.0),
        engine=AUTO,
        ipc=ipc,
        train=dataclasses.replace(cfg.train, save_every=10),
        launch=dataclasses.replace(cfg.launch, runner="inprocess"),
    )


def plan(ipc: IpcConfig, clip: bool, machine: Machine) -> MemoryPlan:
    """The run's memory plan on `machine`, as its driver makes it before anything is spawned."""
    return run_plan(run(ipc, clip), build_spec(MODEL), cuda=True, executors=1, machine=machine)


def request(
    rid: str, ipc: IpcConfig, machine: Machine, clip: bool = True, spec: ModelSpec | None = None
) -> StoreRequest:
    """The owner's request for MODEL, one packer and one accumulator, the engine's sizes still `auto`, with the
    run's memory plan on `machine`."""
    return StoreRequest(
        run_id=rid,
        model=MODEL,
        no_decay_1d=True,
        clip=clip,
        engine=AUTO,
        num_packers=1,
        num_accumulators=1,
        ipc=ipc,
        batch_shape=BATCH,
        spec=spec,
        memory=plan(ipc, clip, machine),
    )


def create(owner: StoreOwner, rid: str, ipc: IpcConfig, clip: bool = True) -> None:
    """The owner's store, planned on its node's memory now."""
    owner.create(request(rid, ipc, owner.node_machine(ipc.shm_dir), clip))


def reserve(mode: str, clip: bool) -> int:
    """The processes' memory beside the store as the run's memory plan counts it (the machine does not
    change it: any will do)."""
    machine = Machine(ram=2**40, total=2**40, shm=2**40, threshold=None)
    return plan(IpcConfig(staging=mode), clip, machine).reserve


def need(mode: str, engine: EngineConfig, clip: bool = True) -> int:
    """RAM the store, its pinned checkpoints, its page tables and the processes' reserve need, as check_space
    counts it."""
    spec = plan_store("x", build_spec(MODEL), "bf16", 2, 1, 1, IpcConfig(staging=mode), cuda=True, clip=clip)
    parts = spec.part_bytes()
    return (
        sum(parts.values())
        + len(parts) * HEADER_BYTES
        + checkpoint_host_bytes(spec.model, engine, *BATCH)
        + reserve(mode, clip)
        + spec.page_table_bytes()
    )


def test_the_reserve_is_the_processes_of_the_roles_that_run() -> None:
    """An executor's CUDA context, the owner, the reaper, Adam and the writer; slabs add a packer and, with
    clipping, an accumulator, each a CPU role's (the PSS measured on the H200)."""
    gib = 2**30
    executor, cpu, reaper = int(1.4 * gib), int(0.7 * gib), int(0.01 * gib)
    assert reserve("resident", True) == executor + 3 * cpu + reaper
    assert reserve("slabs", True) == executor + 5 * cpu + reaper
    assert reserve("slabs", False) == executor + 4 * cpu + reaper


def test_chosen_sizes_reorder_the_walk_and_keep_the_store(rid: str) -> None:
    owner = StoreOwner()
    try:
        create(owner, rid, IpcConfig())
        made = owner.store
        params = made.torch_tile("params", 1).clone()
        assert made.spec.checkpoint_interval == 2 and made.spec.staging_mode == "resident"
        spec = owner.settle(CHOSEN)
        assert owner.store is made and spec.checkpoint_interval == 1 and spec.last_block_layers == 1
        assert spec.blocks == [[1], [2], [3], [4]]
        assert torch.equal(owner.store.torch_tile("params", 1), params)
        worker = Store.attach(spec, ("staging", "resident"))  # the segments' header fits the settled spec
        worker.close()
    finally:
        owner.shutdown()
    assert not leftovers(rid)


def test_the_staging_is_decided_once_and_sizes_that_overturn_it_are_refused(rid: str, monkeypatch) -> None:
    """Without clipping (with it, auto is always resident: its copy holds the gradients, the least memory):
    the owner's plan decides resident on the memory before the store; chosen sizes whose pinned checkpoints
    leave no room beside the resident copy are refused with the numbers, and the store stays as it was."""
    avail = need("resident", fixed_sizes(AUTO), False)
    assert avail < need("resident", CHOSEN, False), "the test model's chosen sizes must pin more checkpoints"
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: avail)
    owner = StoreOwner()
    try:
        create(owner, rid, IpcConfig(), clip=False)
        made = owner.store
        assert made.spec.staging_mode == owner.memory.staging_mode == "resident"
        with pytest.raises(ResourceError, match=r"activation checkpoints .* GiB.*processes, after the store"):
            owner.settle(CHOSEN)
        assert owner.store is made and made.spec.staging_mode == "resident"
    finally:
        owner.shutdown()
    assert not leftovers(rid)


def test_an_explicit_staging_that_no_longer_fits_is_refused_with_the_numbers(rid: str, monkeypatch) -> None:
    avail = need("resident", fixed_sizes(AUTO))
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: avail)
    owner = StoreOwner()
    try:
        create(owner, rid, IpcConfig(staging="resident"))
        with pytest.raises(ResourceError, match="activation checkpoints"):
            owner.settle(CHOSEN)
    finally:
        owner.shutdown()
    assert not leftovers(rid)


def test_a_shutdown_during_the_fill_stops_it_and_leaves_nothing(rid: str) -> None:
    owner = StoreOwner()
    owner.done.set()  # the driver gave up (the executor failed) before the owner got to the store
    with pytest.raises(Exception, match="shut down before its store was made"):
        create(owner, rid, IpcConfig())
    owner.shutdown()
    assert not leftovers(rid)


def test_the_zero_planes_are_paged_in_once_asked_and_keep_their_bytes(rid: str) -> None:
    """Not during the fill (it would slow it and the executor's pinning): once the driver asks."""
    owner = StoreOwner()
    try:
        create(owner, rid, IpcConfig())
        assert owner.paging is None
        owner.page_in()
        owner.paging.join(timeout=60)
        store = owner.store

        def inside() -> int:
            # one read per plane: the process's total moves between two reads (the first read alone allocates)
            splits = [shm.pss_split(os.getpid(), f"megatrain-{rid}-{p}") for p in ("exp_avg", "exp_avg_sq")]
            return sum(total - outside for total, outside in splits)

        assert inside() >= 0.9 * 2 * store.plane("exp_avg").nbytes  # resident without a byte written
        assert not store.plane("exp_avg").any() and not store.plane("exp_avg_sq").any()
        assert hostmem.populate(store.plane("params")[:1000])
    finally:
        owner.shutdown()
    assert owner.paging is None and not leftovers(rid)


def test_the_drivers_spec_is_used_and_the_fills_pages_are_faulted_in_ahead(rid: str, monkeypatch) -> None:
    """With the driver's spec in the request the owner builds none of its own, and while the fill runs threads
    of its own fault in the params and resident segments (whole), stopped and gone once the fill is done;
    the fill is the one a request without the spec gives."""
    import threading

    from megatrain.actors import store_owner

    seen: list[list[tuple[int, int]]] = []
    real = store_owner.fault_in

    def recording(ranges, threads, stop=None):
        seen.append(list(ranges))
        return real(ranges, threads, stop)

    monkeypatch.setattr(store_owner, "fault_in", recording)
    monkeypatch.setattr(store_owner, "build_spec", lambda *a, **k: pytest.fail("the owner built a spec"))
    spec = build_spec(MODEL)
    owner = StoreOwner()
    try:
        owner.create(request(rid, IpcConfig(), owner.node_machine(), spec=spec))
        assert owner.model is spec and owner.store.spec.staging_mode == "resident"
        segs = owner.store.segments
        assert seen == [
            [(addr(segs["params"]), len(segs["params"].mm)), (addr(segs["resident"]), len(segs["resident"].mm))]
        ]
        assert not [t for t in threading.enumerate() if t.name.startswith(("fault-ahead", "fault-in"))]
        params = owner.store.plane("params").copy()
    finally:
        owner.shutdown()
    monkeypatch.undo()
    again = StoreOwner()
    try:
        create(again, rid + "b", IpcConfig())
        assert (again.store.plane("params") == params).all()
    finally:
        again.shutdown()


def addr(segment) -> int:
    return np.frombuffer(segment.mm, np.uint8).ctypes.data
