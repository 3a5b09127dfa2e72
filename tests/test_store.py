"""The Store (ipc/protocol.py) without Ray: planes, alignment, work partition, waits, unlink.

Every test uses its own run id and removes what it made in a finally block; the `rid` fixture then
checks that nothing of the run is left in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import stat
import threading
import time

import numpy as np
import pytest
import torch

from megatrain.actors.executor.streams import SyncSink
from megatrain.errors import AbortError, LayoutMismatch, ProtocolError, ResourceError, WaitTimeout
from megatrain.ipc.protocol import PLANES, Store
from megatrain.ipc.shared import shm
from megatrain.ipc.shared.shm import HEADER_BYTES
from megatrain.launch.control.placement import ActorsConfig, roster_for
from megatrain.model.layout import TILE_ALIGN
from megatrain.roster import Kind, running_workers
from tests.model_fixtures import spec_for, tiny_hf
from tests.shm_fixtures import ALL_PARTS, SHM, leftovers, make_spec, owned, remove_all

# ---- the Store --------------------------------------------------------------------------------------------


def test_store_create_and_attach_share_memory(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)) as store:
        names = leftovers(rid)
        segs = [f"megatrain-{rid}-{p}" for p in ("ctl", *PLANES, "staging")]
        assert sorted(segs) == [n for n in names if not n.startswith("sem.")]
        sems = [n for n in names if n.startswith("sem.")]
        assert len(sems) == 1 + 2 * 3 + 2 * 2
        assert all(n.startswith(f"sem.megatrain-{rid}-sem-") for n in sems)
        for n in names:
            assert stat.S_IMODE(os.stat(f"{SHM}/{n}").st_mode) == 0o600, n
        for part, size in spec.part_bytes().items():
            assert os.stat(f"{SHM}/megatrain-{rid}-{part}").st_size == HEADER_BYTES + size
        # Everything starts zeroed.
        for part in PLANES:
            assert not store.plane(part).any()
        assert not store.versions.any() and not store.aborted

        # A worker attaches from the pickled spec (what Ray ships) and records its pid.
        other = Store.attach(pickle.loads(pickle.dumps(spec)), ALL_PARTS, role="packer-1")
        try:
            assert store.pids[spec.pid_slot("packer-1")] == os.getpid()
            rng = np.random.default_rng(0)
            values = rng.standard_normal(spec.layout.total).astype(np.float32)
            store.plane("params")[:] = values
            np.testing.assert_array_equal(other.plane("params"), values)
            other.tile("exp_avg", 2)[:] = 3.5
            u = spec.layout.units[2]
            n = spec.layout.structure_of(2).numel
            seen = store.plane("exp_avg")
            assert (seen[u.offset : u.offset + n] == 3.5).all()
            assert not seen[: u.offset].any() and not seen[u.offset + n :].any()
            other.torch_tile("grads", 0).fill_(-1.0)
            assert (store.tile("grads", 0) == -1.0).all()
            other.weight_slab(1).fill_(2.0)
            assert store.weight_slab(1).dtype == torch.bfloat16 and bool((store.weight_slab(1) == 2.0).all())
            assert not bool(store.weight_slab(0).any()) and not bool(store.weight_slab(2).any())
            store.grad_slab(1).fill_(0.25)
            assert bool((other.grad_slab(1) == 0.25).all()) and not bool(other.grad_slab(0).any())
            other.versions[3] = 7
            other.sqnorms[1] = 2.5
            assert store.versions[3] == 7 and store.sqnorms[1] == 2.5
            # Semaphores are shared too.
            other.post("g_full1")
            store.wait("g_full1", "a posted slab")
        finally:
            other.close()
    assert leftovers(rid) == []


@pytest.mark.parametrize("staging", ["bf16", "fp32"])
def test_tiles_and_slabs_are_page_aligned(rid: str, model_spec, staging: str) -> None:
    spec = make_spec(rid, model_spec, staging=staging, weight_slabs=3, grad_slabs=3)
    with owned(Store.create(spec)) as store:
        for part in ("params", "exp_avg", "exp_avg_sq", "grads"):
            base = np.frombuffer(store.segments[part].mm, np.uint8).ctypes.data
            prev_end = base + HEADER_BYTES
            for unit in range(spec.num_units):
                tile = store.tile(part, unit)
                start = tile.ctypes.data
                assert (start - base) % 4096 == 0 and start % 4096 == 0, (part, unit)
                assert start >= prev_end
                prev_end = start + tile.nbytes
                # The same tile seen as bf16 (2-byte elements) starts on the same page boundary.
                half = np.frombuffer(store.segments[part].mm, np.uint16, 1, start - base)
                assert half.ctypes.data % 4096 == 0
            assert prev_end <= base + HEADER_BYTES + spec.part_bytes()[part]
        staging_mm = store.segments["staging"].mm
        base = np.frombuffer(staging_mm, np.uint8).ctypes.data
        elem = 2 if staging == "bf16" else 4
        slabs = [store.weight_slab(i) for i in range(3)] + [store.grad_slab(i) for i in range(3)]
        assert [s.dtype for s in slabs[:3]] == [torch.bfloat16 if staging == "bf16" else torch.float32] * 3
        assert all(s.dtype == torch.float32 for s in slabs[3:])
        for i, slab in enumerate(slabs):
            off = slab.data_ptr() - base
            assert off % 4096 == 0, (i, off)
            assert slab.numel() >= max(hi - lo for t in spec.piece_table for _, lo, hi in t)
        ends = [s.data_ptr() + s.numel() * s.element_size() for s in slabs]
        assert all(ends[i] <= slabs[i + 1].data_ptr() for i in range(5))
        assert ends[-1] <= base + HEADER_BYTES + spec.part_bytes()["staging"]
        assert slabs[0].data_ptr() - base == HEADER_BYTES
        assert slabs[3].data_ptr() - base == HEADER_BYTES + 3 * spec.slab_elems * elem
        region = store.region("staging")
        assert region.data_ptr() - base == HEADER_BYTES and region.numel() == spec.part_bytes()["staging"]
    assert leftovers(rid) == []


def check_partition(order: list[int], grouped: list, items_of, workers: int, slabs: int, spec) -> None:
    """Items walk `order` unit by unit, each unit's pieces in turn; item j uses slab j % slabs and slab s
    is always served by worker s % workers, so a worker's items are its slabs' uses in walk order."""
    assert [items[0].unit for items in grouped] == order
    walk = [it for items in grouped for it in items]
    for items in grouped:
        unit = items[0].unit
        assert [(it.piece, it.lo, it.hi) for it in items] == list(spec.piece_table[unit])
        assert items[0].lo == 0 and items[-1].hi == spec.layout.structure_of(unit).numel
    assert [it.slab for it in walk] == [j % slabs for j in range(len(walk))]
    lists = [items_of(w) for w in range(workers)]
    assert lists == [[it for it in walk if it.slab % workers == w] for w in range(workers)]
    if slabs >= workers and len(walk) >= workers:
        assert all(lists), "a worker with no items"


@pytest.mark.parametrize("slabs, workers", [(1, 1), (4, 1), (4, 2), (3, 2), (5, 3), (2, 2), (8, 3)])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("slab_params", [0, 3000])
def test_weight_and_grad_items_partition_the_orders(
    model_spec, slabs: int, workers: int, k: int, slab_params: int
) -> None:
    spec = make_spec(
        "partition",
        model_spec,
        k=k,
        packers=workers,
        accs=workers,
        weight_slabs=slabs,
        grad_slabs=slabs,
        slab_params=slab_params,
    )
    n = spec.layout.num_layers
    assert sorted(set(spec.fetch_order)) == list(range(n + 2))
    check_partition(spec.fetch_order, spec.fetch_items, spec.weight_items, workers, slabs, spec)
    check_partition(spec.grad_order, spec.emit_items, spec.grad_items, workers, slabs, spec)


def test_pieces_tile_every_unit_within_one_slab(model_spec) -> None:
    """Default slabs hold the largest decoder layer: layers are one piece, larger units several."""
    spec = make_spec("pieces", model_spec)
    layer = max(spec.layout.structure_of(u.index).numel for u in spec.layout.units if u.kind == "layer")
    assert spec.slab_elems >= layer and spec.slab_elems % TILE_ALIGN == 0
    flat = [p for t in spec.piece_table for p in t]
    assert [p for p, _, _ in flat] == list(range(spec.num_pieces))
    for unit, table in enumerate(spec.piece_table):
        numel = spec.layout.structure_of(unit).numel
        assert [lo for _, lo, _ in table] == list(range(0, numel, spec.slab_elems))
        assert table[-1][2] == numel and all(0 < hi - lo <= spec.slab_elems for _, lo, hi in table)
        assert spec.piece_range(unit) == slice(table[0][0], table[-1][0] + 1)
        if spec.layout.units[unit].kind == "layer":
            assert len(table) == 1
    small = make_spec("pieces", model_spec, slab_params=3000)
    assert small.slab_elems == 4096 and small.part_bytes()["staging"] < spec.part_bytes()["staging"]
    assert [len(t) for t in small.piece_table] == [2, 3, 3, 3, 3]  # 8192, 3 x 9280, 8224 elements


@pytest.mark.parametrize("packers, accs", [(1, 1), (2, 3), (4, 2)])
def test_every_worker_role_has_its_own_pid_slot(model_spec, packers: int, accs: int) -> None:
    spec = make_spec("slots", model_spec, packers=packers, accs=accs, weight_slabs=4, grad_slabs=4)
    actors = ActorsConfig(num_packers=packers, num_accumulators=accs)
    roster = roster_for(actors, cuda=False, clip=True, writer=True, staging="slabs", executors=1)
    roles = [r.name for r in roster.workers]
    slots = [spec.pid_slot(r) for r in roles]
    assert len(set(slots)) == len(roles)
    assert all(0 <= s < shm.MAX_PIDS for s in slots)


def test_wait_raises_abort_error_promptly_with_the_reason(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)  # default wait_timeout_s: 600
    with owned(Store.create(spec)) as store:
        other = Store.attach(spec, ())
        timer = threading.Timer(0.3, other.abort, args=("grad-accumulator-0: RuntimeError: boom",))
        t0 = time.monotonic()
        timer.start()
        try:
            with pytest.raises(AbortError) as info:
                store.wait("grads_ready", "gradients of unit 4")
        finally:
            timer.cancel()
            timer.join()
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 10.0  # woken by the abort, far from the 600 s timeout, with room for a busy machine
        assert "grad-accumulator-0: RuntimeError: boom" in str(info.value)
        assert store.aborted and store.abort_reason() == "grad-accumulator-0: RuntimeError: boom"
        store.abort("a later failure")  # the first (root) cause is kept
        assert store.abort_reason() == "grad-accumulator-0: RuntimeError: boom"
        with pytest.raises(AbortError, match="boom"):
            store.wait("w_free0", "a free slab")  # even an available semaphore is not taken after abort
        with pytest.raises(AbortError, match="boom"):
            store.wait_version(1, 1, "unit 1")
        other.close()
    assert leftovers(rid) == []


def test_wait_times_out_with_a_tiny_timeout(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec, wait_timeout_s=0.2, poll_s=0.02)
    with owned(Store.create(spec)) as store:
        store.wait("w_free0", "a free slab")  # free slabs start at 1
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="a free slab"):
            store.wait("w_free0", "a free slab")
        assert 0.19 <= time.monotonic() - t0 < 10.0  # never early; late only by what a busy machine adds
        with pytest.raises(WaitTimeout, match="weights of unit 2"):
            store.wait("w_full0", "weights of unit 2")  # full slabs start at 0
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="version of unit 1"):
            store.wait_version(1, 1, "version of unit 1")
        assert 0.19 <= time.monotonic() - t0 < 10.0
        store.versions[spec.piece_range(1)] = 1
        store.wait_version(1, 1, "version of unit 1")  # reached: returns at once
        store.post("grads_ready")
        store.wait("grads_ready", "grads")
    assert leftovers(rid) == []


def test_unlink_removes_every_segment_and_semaphore(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    store = Store.create(spec)
    other, unlinked = None, False
    try:
        other = Store.attach(spec, ALL_PARTS, role="gpu-executor")
        store.plane("params")[:4] = 1.0
        assert len(leftovers(rid)) == 6 + 1 + 2 * 3 + 2 * 2
        store.unlink()
        unlinked = True
        assert leftovers(rid) == []
        assert other.plane("params")[:4].tolist() == [1.0] * 4  # mappings outlive the names
        with pytest.raises(LayoutMismatch, match="does not exist"):
            Store.attach(spec, ("params",))
        again = Store.create(spec)  # the names are free again
        again.unlink()
        again.close()
    finally:
        if other is not None:
            other.close()
        if not unlinked:
            store.unlink()
        store.close()
    assert leftovers(rid) == []


def test_unlink_twice_is_harmless(rid: str, model_spec) -> None:
    store = Store.create(make_spec(rid, model_spec))
    try:
        store.unlink()
        store.unlink()
    finally:
        remove_all(rid)
        store.close()
    assert leftovers(rid) == []


def test_attach_to_a_store_of_another_plan_fails(rid: str, model_spec) -> None:
    with owned(Store.create(make_spec(rid, model_spec, weight_slabs=3))):
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, model_spec, weight_slabs=4), ("params",))
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, model_spec, staging="fp32"), ("params",))
        tied = spec_for(tiny_hf("llama", tied=True, layers=3), "llama")
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, tied, weight_slabs=3), ("params",))
    assert leftovers(rid) == []


def test_second_create_of_a_live_run_fails_without_harming_it(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)):
        before = leftovers(rid)
        with pytest.raises(ResourceError, match=f"run_id '{rid}' is in use by a live run"):
            Store.create(spec)
        assert leftovers(rid) == before
        Store.attach(spec, ALL_PARTS).close()
    assert leftovers(rid) == []


def test_create_refuses_a_store_that_does_not_fit(rid: str, model_spec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda shm_dir="/dev/shm": 10_000)
    try:
        with pytest.raises(ResourceError, match="GiB"):
            Store.create(make_spec(rid, model_spec))
    finally:
        remove_all(rid)
    assert leftovers(rid) == []


def accumulators(spec) -> int:
    """The accumulators a run with the store of `spec` starts (the roster's rule)."""
    workers = running_workers(
        packers=spec.num_packers, accumulators=spec.num_accumulators, clip=spec.clip, staging=spec.staging_mode
    )
    return workers[Kind.ACCUMULATOR]


def test_a_resident_copy_holds_the_gradients_no_plane_slabs_or_accumulators(model_spec) -> None:
    slabs = make_spec("plan-a", model_spec, staging_mode="slabs")
    resident = dataclasses.replace(slabs, staging_mode="resident")
    assert slabs.planes == PLANES and accumulators(slabs) == 2 and slabs.num_grad_slabs == 2
    assert resident.grads_in_resident and "grads" not in resident.planes
    assert accumulators(resident) == 0 and resident.num_grad_slabs == 0
    assert resident.part_bytes()["staging"] == TILE_ALIGN  # no slabs at all: a page
    assert not any(k.startswith("g_") for k in resident.sem_names())
    unclipped = dataclasses.replace(resident, clip=False)  # Adam takes them from the copy as they come
    assert unclipped.grads_in_resident and unclipped.num_grad_slabs == 0
    assert [it.unit for it in unclipped.update_items][:1] == unclipped.grad_order[:1]  # the head first


def test_a_gradient_never_overwrites_weights_the_step_still_fetches(rid: str, model_spec) -> None:
    """The executor's sink refuses a gradient whose unit the engine's walk has not fetched for the last time:
    in the resident copy it would overwrite weights yet to be read."""
    spec = make_spec(rid, model_spec, staging="fp32", staging_mode="resident")
    fetched = [0]
    with owned(Store.create(spec)) as store:
        sink = SyncSink(store, lambda: fetched[0])
        head = spec.grad_order[0]
        grad = torch.ones(spec.layout.structure_of(head).numel)
        fetched[0] = spec.last_fetch[head]  # the head's own fetch not yet taken
        with pytest.raises(ProtocolError, match=f"gradient of unit {head} .* overwrite"):
            sink.emit(head, grad)
        sink.begin()
        fetched[0] = spec.last_fetch[head] + 1
        sink.emit(head, grad)
        assert (store.resident_tile(head) == 1.0).all()
        assert store.sqnorms[spec.piece_range(head)].sum() == grad.numel()
        store.wait("grads_ready", "the head's gradient")
