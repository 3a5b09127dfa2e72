"""Shared memory without Ray: segments, headers, space checks, the sweeper, the reaper and the Store.

Every test uses its own run id and removes what it made in a finally block; the `rid` fixture then
checks that nothing of the run is left in /dev/shm.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import posix_ipc
import pytest
import torch
from megatrain.ipc import shm
from megatrain.ipc.protocol import PLANES, IpcConfig, Store, StoreSpec
from megatrain.ipc.shm import HEADER_BYTES, Header, Segment, seg_name, sem_name
from megatrain.launch.placement import ActorsConfig, demands

from megatrain.errors import AbortError, LayoutMismatch, ResourceError, WaitTimeout
from tests.helpers import spec_for, tiny_hf

SHM = "/dev/shm"
HASH = bytes(range(16))
ALL_PARTS = (*PLANES, "staging")


def leftovers(rid: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if rid in n)


def remove_all(rid: str) -> None:
    shm.unlink_entries(shm.run_entries(SHM).get(rid, []))


@pytest.fixture
def rid():
    run_id = "test" + secrets.token_hex(4)
    try:
        yield run_id
    finally:
        left = leftovers(run_id)
        remove_all(run_id)
        assert not left, f"test left {left} in {SHM}"


@pytest.fixture(scope="module")
def model_spec():
    return spec_for(tiny_hf("llama", tied=False, layers=3), "llama")


def make_spec(rid: str, model_spec, staging: str = "bf16", k: int = 2, packers: int = 2, accs: int = 2,
              **ipc) -> StoreSpec:
    ipc = {"weight_slabs": 3, "grad_slabs": 2, **ipc}
    return StoreSpec(rid, model_spec, staging, k, packers, accs, IpcConfig(**ipc))


def child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---- segments ------------------------------------------------------------------------------------


def test_segment_create_names_mode_header_and_attach(rid: str) -> None:
    name = seg_name(rid, "params")
    assert name == f"/megatrain-{rid}-params"
    seg = Segment.create(name, 12345, Header(HASH, rid))
    try:
        st = os.stat(f"{SHM}/megatrain-{rid}-params")
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == HEADER_BYTES + 12345
        assert seg.owner and seg.data_bytes == 12345
        assert seg.header.owner_pid == os.getpid()
        assert seg.header.owner_ticks == shm.start_ticks(os.getpid()) > 0
        other = Segment.attach(name, HASH, rid)
        try:
            assert not other.owner and other.header == seg.header
            seg.mm[HEADER_BYTES:HEADER_BYTES + 5] = b"hello"
            assert other.mm[HEADER_BYTES:HEADER_BYTES + 5] == b"hello"
            other.mm[-3:] = b"end"
            assert seg.mm[-3:] == b"end"
        finally:
            other.close()
        with pytest.raises(posix_ipc.ExistentialError):  # the one owner creates, exclusively
            Segment.create(name, 10, Header(HASH, rid))
    finally:
        seg.unlink()
        seg.close()
    assert leftovers(rid) == []


def test_attach_with_wrong_layout_hash(rid: str) -> None:
    name = seg_name(rid, "ctl")
    seg = Segment.create(name, 64, Header(HASH, rid))
    try:
        with pytest.raises(LayoutMismatch) as info:
            Segment.attach(name, bytes(16), rid)
        msg = str(info.value)
        assert name in msg and "layout hash differs" in msg
    finally:
        seg.unlink()
        seg.close()
    assert leftovers(rid) == []


def test_attach_with_wrong_run_id(rid: str) -> None:
    name = seg_name(rid, "ctl")
    seg = Segment.create(name, 64, Header(HASH, "someoneelse"))
    try:
        with pytest.raises(LayoutMismatch) as info:
            Segment.attach(name, HASH, rid)
        msg = str(info.value)
        assert name in msg and "run id 'someoneelse'" in msg and f"expected '{rid}'" in msg
    finally:
        seg.unlink()
        seg.close()
    assert leftovers(rid) == []


def test_attach_missing_or_foreign_segment(rid: str) -> None:
    with pytest.raises(LayoutMismatch, match="does not exist"):
        Segment.attach(seg_name(rid, "params"), HASH, rid)
    raw = posix_ipc.SharedMemory(seg_name(rid, "params"), posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    raw.close_fd()
    try:
        with pytest.raises(LayoutMismatch, match="bad magic"):
            Segment.attach(seg_name(rid, "params"), HASH, rid)
    finally:
        posix_ipc.unlink_shared_memory(seg_name(rid, "params"))
    assert leftovers(rid) == []


def test_run_id_check() -> None:
    assert shm.check_run_id("abc123") == "abc123"
    for bad in ("", "Abc", "a-b", "a_b", "x" * 33, "../etc"):
        with pytest.raises(ValueError, match="lowercase letters and digits"):
            shm.check_run_id(bad)


# ---- space checks ----------------------------------------------------------------------------------


def test_check_space_refuses_more_than_free_with_gib_numbers() -> None:
    free = shm.shm_free_bytes(SHM)
    with pytest.raises(ResourceError) as info:
        shm.check_space({"params": free + 2**30, "ctl": 100}, SHM)
    msg = str(info.value)
    assert SHM in msg and "params" in msg
    numbers = re.findall(r"(\d+\.\d\d) GiB", msg)
    assert len(numbers) >= 3  # what it needs, per part, what is free
    need = (free + 2**30 + 100 + 2 * HEADER_BYTES) / 2**30
    assert f"{need:.2f}" in numbers


def test_check_space_accepts_a_small_store() -> None:
    shm.check_space({"params": 2**20, "ctl": 4096}, SHM)


def test_check_space_refuses_more_than_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: 3 * 2**20)
    with pytest.raises(ResourceError, match=r"RAM .*0\.00 GiB is available"):
        shm.check_space({"params": 2**24}, SHM)


# ---- the sweeper -------------------------------------------------------------------------------------

DEAD_OWNER = textwrap.dedent("""
    import os, struct, sys
    import posix_ipc
    from megatrain.ipc.shm import CTL_PIDS_OFFSET, HEADER_BYTES, Header, Segment, seg_name, sem_name
    rid = sys.argv[1]
    ctl = Segment.create(seg_name(rid, "ctl"), 4096, Header(bytes(range(16)), rid))
    ctl.mm[HEADER_BYTES + CTL_PIDS_OFFSET: HEADER_BYTES + CTL_PIDS_OFFSET + 8] = struct.pack("<q", os.getpid())
    Segment.create(seg_name(rid, "params"), 8192, Header(bytes(range(16)), rid))
    posix_ipc.Semaphore(sem_name(rid, "wfree0"), posix_ipc.O_CREX, mode=0o600, initial_value=1)
    print(os.getpid(), flush=True)
""")

LIVE_OWNER = DEAD_OWNER + "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def test_sweep_removes_a_run_whose_owner_died(rid: str) -> None:
    cuda_file = None
    try:
        out = subprocess.run([sys.executable, "-c", DEAD_OWNER, rid], check=True, capture_output=True,
                             text=True, timeout=60, env=child_env())
        pid = int(out.stdout.split()[0])
        expected = {f"megatrain-{rid}-ctl", f"megatrain-{rid}-params", f"sem.megatrain-{rid}-sem-wfree0"}
        assert set(leftovers(rid)) == expected
        owner = shm.read_owner(rid)
        assert owner is not None and owner[0] == pid and not shm.pid_alive(*owner)
        assert shm.read_worker_pids(rid) == [pid]
        # What the CUDA driver would leave for a SIGKILLed worker that the ctl segment names.
        cuda_file = f"{SHM}/cuda.shm.0.{pid:x}.1"
        open(cuda_file, "w").close()
        removed = shm.sweep(rid)
        assert set(removed) == expected | {os.path.basename(cuda_file)}
        assert leftovers(rid) == [] and not os.path.exists(cuda_file)
        assert shm.sweep(rid) == []  # idempotent
    finally:
        remove_all(rid)
        if cuda_file and os.path.exists(cuda_file):
            os.unlink(cuda_file)
    assert leftovers(rid) == []


def test_sweep_leaves_a_run_whose_owner_is_alive(rid: str) -> None:
    ctl = Segment.create(seg_name(rid, "ctl"), 4096, Header(HASH, rid))
    params = Segment.create(seg_name(rid, "params"), 4096, Header(HASH, rid))
    sem = posix_ipc.Semaphore(sem_name(rid, "x"), posix_ipc.O_CREX, mode=0o600)
    try:
        before = leftovers(rid)
        assert len(before) == 3
        assert shm.read_owner(rid) == (os.getpid(), shm.start_ticks(os.getpid()))
        assert shm.sweep(rid) == []
        assert leftovers(rid) == before
    finally:
        sem.unlink()
        sem.close()
        params.unlink()
        ctl.unlink()
        ctl.close()
        params.close()
    assert leftovers(rid) == []


def test_sweep_detects_a_reused_owner_pid(rid: str) -> None:
    # The header names this (live) pid but a different start time: the pid was reused, the owner is dead.
    ctl = Segment.create(seg_name(rid, "ctl"), 4096, Header(HASH, rid))
    try:
        hdr = Header(HASH, rid, os.getpid(), shm.start_ticks(os.getpid()) + 12345, 4096)
        ctl.mm[: len(hdr.pack())] = hdr.pack()
        assert not shm.pid_alive(os.getpid(), hdr.owner_ticks)
        assert shm.sweep(rid) == [f"megatrain-{rid}-ctl"]
        assert leftovers(rid) == []
    finally:
        ctl.unlink()
        ctl.close()
    assert leftovers(rid) == []


def test_sweep_spares_a_young_ctl_without_header_but_not_an_old_one(rid: str) -> None:
    name = seg_name(rid, "ctl")
    raw = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    raw.close_fd()
    try:
        assert shm.read_owner(rid) is None
        assert shm.sweep(rid) == []  # being created right now
        old = time.time() - 120
        os.utime(f"{SHM}/megatrain-{rid}-ctl", (old, old))
        assert shm.sweep(rid) == [f"megatrain-{rid}-ctl"]
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
    assert leftovers(rid) == []


# ---- the reaper ------------------------------------------------------------------------------------------


def start_reaper(rid: str, pid: int, ticks: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatrain.ipc.reaper", rid, str(pid), str(ticks)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env())


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(timeout=10)


def test_reaper_unlinks_after_the_owner_is_sigkilled(rid: str) -> None:
    owner = reaper = None
    try:
        owner = subprocess.Popen([sys.executable, "-c", LIVE_OWNER, rid], stdout=subprocess.PIPE, text=True,
                                 env=child_env())
        pid = int(owner.stdout.readline())
        assert owner.stdout.readline().strip() == "ready"
        assert len(leftovers(rid)) == 3
        reaper = start_reaper(rid, pid, shm.start_ticks(pid))
        time.sleep(0.8)  # several polls with the owner alive: nothing may go
        assert reaper.poll() is None
        assert len(leftovers(rid)) == 3
        owner.kill()
        owner.wait(timeout=10)  # reaped, as Ray's raylet would; a zombie still counts as alive
        _, err = reaper.communicate(timeout=20)  # the reaper's worker wait is bounded at 10 s
        assert reaper.returncode == 0
        assert leftovers(rid) == []
        assert f"owner pid {pid} of run {rid} died" in err
    finally:
        stop(owner)
        stop(reaper)
        remove_all(rid)
    assert leftovers(rid) == []


def test_reaper_exits_untouched_when_the_ctl_segment_is_unlinked(rid: str) -> None:
    ctl = Segment.create(seg_name(rid, "ctl"), 4096, Header(HASH, rid))
    params = Segment.create(seg_name(rid, "params"), 4096, Header(HASH, rid))
    sem = posix_ipc.Semaphore(sem_name(rid, "x"), posix_ipc.O_CREX, mode=0o600)
    reaper = None
    try:
        reaper = start_reaper(rid, os.getpid(), shm.start_ticks(os.getpid()))
        time.sleep(0.8)
        assert reaper.poll() is None  # watching
        ctl.unlink()  # the owner's normal shutdown unlinks ctl last; here the rest stays, to be checked
        out, err = reaper.communicate(timeout=10)
        assert reaper.returncode == 0 and out == "" and err == ""
        assert leftovers(rid) == [f"megatrain-{rid}-params", f"sem.megatrain-{rid}-sem-x"]
    finally:
        stop(reaper)
        sem.unlink()
        sem.close()
        params.unlink()
        ctl.unlink()
        ctl.close()
        params.close()
    assert leftovers(rid) == []


# ---- the Store --------------------------------------------------------------------------------------------


def test_store_create_and_attach_share_memory(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    store = Store.create(spec)
    try:
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
            assert (seen[u.offset:u.offset + n] == 3.5).all()
            assert not seen[:u.offset].any() and not seen[u.offset + n:].any()
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
    finally:
        store.unlink()
        store.close()
    assert leftovers(rid) == []


@pytest.mark.parametrize("staging", ["bf16", "fp32"])
def test_tiles_and_slabs_are_page_aligned(rid: str, model_spec, staging: str) -> None:
    spec = make_spec(rid, model_spec, staging=staging, weight_slabs=3, grad_slabs=3)
    store = Store.create(spec)
    try:
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
            assert slab.numel() >= spec.layout.max_unit_numel
        ends = [s.data_ptr() + s.numel() * s.element_size() for s in slabs]
        assert all(ends[i] <= slabs[i + 1].data_ptr() for i in range(5))
        assert ends[-1] <= base + HEADER_BYTES + spec.part_bytes()["staging"]
        assert slabs[0].data_ptr() - base == HEADER_BYTES
        assert slabs[3].data_ptr() - base == HEADER_BYTES + 3 * spec.slab_elems * elem
        region = store.region("staging")
        assert region.data_ptr() - base == HEADER_BYTES and region.numel() == spec.part_bytes()["staging"]
    finally:
        store.unlink()
        store.close()
    assert leftovers(rid) == []


def check_partition(order: list[int], items_of, workers: int, slabs: int) -> None:
    lists = [items_of(w) for w in range(workers)]
    owner_of_slab: dict[int, set[int]] = {}
    for w, items in enumerate(lists):
        for _, slab in items:
            owner_of_slab.setdefault(slab, set()).add(w)
    assert all(len(ws) == 1 for ws in owner_of_slab.values()), owner_of_slab
    assert sorted(owner_of_slab) == list(range(min(slabs, len(order))))
    # Walking the order, item j (slab j % slabs) is the next item of exactly its slab's worker.
    cursor = [0] * workers
    for j, unit in enumerate(order):
        slab = j % slabs
        (w,) = owner_of_slab[slab]
        assert lists[w][cursor[w]] == (unit, slab), (j, w)
        cursor[w] += 1
    assert cursor == [len(x) for x in lists]  # nothing extra, nothing missing
    if slabs >= workers and len(order) >= workers:
        assert all(lists), "a worker with no items"


@pytest.mark.parametrize("slabs, workers", [(1, 1), (4, 1), (4, 2), (3, 2), (5, 3), (2, 2), (8, 3)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_weight_and_grad_items_partition_the_orders(model_spec, slabs: int, workers: int, k: int) -> None:
    spec = make_spec("partition", model_spec, k=k, packers=workers, accs=workers, weight_slabs=slabs,
                     grad_slabs=slabs)
    n = spec.layout.num_layers
    assert sorted(set(spec.fetch_order)) == list(range(n + 2))
    check_partition(spec.fetch_order, spec.weight_items, workers, slabs)
    check_partition(spec.grad_order, spec.grad_items, workers, slabs)


@pytest.mark.parametrize("packers, accs", [(1, 1), (2, 3), (4, 2)])
def test_every_worker_role_has_its_own_pid_slot(model_spec, packers: int, accs: int) -> None:
    spec = make_spec("slots", model_spec, packers=packers, accs=accs, weight_slabs=4, grad_slabs=4)
    roles = [r for r in demands(ActorsConfig(num_packers=packers, num_accumulators=accs), cuda=False)
             if r != "store-owner"]
    slots = [spec.pid_slot(r) for r in roles]
    assert len(set(slots)) == len(roles)
    assert all(0 <= s < shm.MAX_PIDS for s in slots)


def test_wait_raises_abort_error_promptly_with_the_reason(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)  # default wait_timeout_s: 600
    store = Store.create(spec)
    try:
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
        assert 0.25 <= elapsed < 2.0
        assert "grad-accumulator-0: RuntimeError: boom" in str(info.value)
        assert store.aborted and store.abort_reason() == "grad-accumulator-0: RuntimeError: boom"
        store.abort("a later failure")  # the first (root) cause is kept
        assert store.abort_reason() == "grad-accumulator-0: RuntimeError: boom"
        with pytest.raises(AbortError, match="boom"):
            store.wait("w_free0", "a free slab")  # even an available semaphore is not taken after abort
        with pytest.raises(AbortError, match="boom"):
            store.wait_version(1, 1, "unit 1")
        other.close()
    finally:
        store.unlink()
        store.close()
    assert leftovers(rid) == []


def test_wait_times_out_with_a_tiny_timeout(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec, wait_timeout_s=0.2, poll_s=0.02)
    store = Store.create(spec)
    try:
        store.wait("w_free0", "a free slab")  # free slabs start at 1
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="a free slab"):
            store.wait("w_free0", "a free slab")
        assert 0.19 <= time.monotonic() - t0 < 2.0
        with pytest.raises(WaitTimeout, match="weights of unit 2"):
            store.wait("w_full0", "weights of unit 2")  # full slabs start at 0
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="version of unit 1"):
            store.wait_version(1, 1, "version of unit 1")
        assert 0.19 <= time.monotonic() - t0 < 2.0
        store.versions[1] = 1
        store.wait_version(1, 1, "version of unit 1")  # reached: returns at once
        store.post("grads_ready")
        store.wait("grads_ready", "grads")
    finally:
        store.unlink()
        store.close()
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
    store = Store.create(make_spec(rid, model_spec, weight_slabs=3))
    try:
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, model_spec, weight_slabs=4), ("params",))
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, model_spec, staging="fp32"), ("params",))
        tied = spec_for(tiny_hf("llama", tied=True, layers=3), "llama")
        with pytest.raises(LayoutMismatch, match="layout hash differs"):
            Store.attach(make_spec(rid, tied, weight_slabs=3), ("params",))
    finally:
        store.unlink()
        store.close()
    assert leftovers(rid) == []


def test_second_create_of_a_live_run_fails_without_harming_it(rid: str, model_spec) -> None:
    spec = make_spec(rid, model_spec)
    store = Store.create(spec)
    try:
        before = leftovers(rid)
        with pytest.raises(posix_ipc.ExistentialError):
            Store.create(spec)
        assert leftovers(rid) == before
        Store.attach(spec, ALL_PARTS).close()
    finally:
        store.unlink()
        store.close()
    assert leftovers(rid) == []


def test_create_refuses_a_store_that_does_not_fit(rid: str, model_spec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda shm_dir="/dev/shm": 10_000)
    try:
        with pytest.raises(ResourceError, match="GiB"):
            Store.create(make_spec(rid, model_spec))
    finally:
        remove_all(rid)
    assert leftovers(rid) == []
