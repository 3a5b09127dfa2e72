"""Shared memory without Ray: segments, headers, space checks, the sweeper, and the reaper.

Every test uses its own run id and removes what it made in a finally block; the `rid` fixture then
checks that nothing of the run is left in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import posix_ipc
import pytest

from megatrain.errors import LayoutMismatch, ResourceError
from megatrain.host import hostmem
from megatrain.ipc import procs
from megatrain.ipc.shared import mapping, segments, shm
from megatrain.ipc.shared.shm import HEADER_BYTES, Header, Segment, seg_name, sem_name
from tests.harness import sleeps_seen, wait_until
from tests.shm_fixtures import DEAD_OWNER, HASH, SHM, child_env, leftovers, owned, remove_all

# Runs without a live owner (segments without a control segment, dead and reused owner pids): another run's
# sweep must not see them (tests/conftest.py).
pytestmark = pytest.mark.shm_alone


# ---- segments ------------------------------------------------------------------------------------


def test_segment_create_names_mode_header_and_attach(rid: str) -> None:
    name = seg_name(rid, "params")
    assert name == f"/megatrain-{rid}-params"
    with owned(Segment.create(name, 12345, Header(HASH, rid))) as seg:
        st = os.stat(f"{SHM}/megatrain-{rid}-params")
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == HEADER_BYTES + 12345
        assert seg.owner and seg.data_bytes == 12345
        assert seg.header.owner_pid == os.getpid()
        assert seg.header.owner_ticks == procs.start_ticks(os.getpid()) > 0
        other = Segment.attach(name, HASH, rid)
        try:
            assert not other.owner and other.header == seg.header
            seg.mm[HEADER_BYTES : HEADER_BYTES + 5] = b"hello"
            assert other.mm[HEADER_BYTES : HEADER_BYTES + 5] == b"hello"
            other.mm[-3:] = b"end"
            assert seg.mm[-3:] == b"end"
        finally:
            other.close()
        with pytest.raises(posix_ipc.ExistentialError):  # the one owner creates, exclusively
            Segment.create(name, 10, Header(HASH, rid))
    assert leftovers(rid) == []


def test_a_large_segment_is_sharded_into_files_mapped_as_one(rid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment over 1 MiB shards: one array across all of them, the same bytes seen by an attacher whose
    own shard constant differs (it reads the layout off the first shard), every shard unlinked by the
    owner, and the sweeper removing every shard of a dead run."""
    monkeypatch.setattr(mapping, "SHARD_BYTES", 1 << 20)
    monkeypatch.setattr(mapping, "ALIGN", 1 << 16)
    name, n = seg_name(rid, "params"), (5 << 20) // 4 + 7
    with owned(Segment.create(name, 4 * n, Header(HASH, rid))) as seg:
        assert len(seg.shards) == 6 and leftovers(rid) == sorted(s[1:] for s in seg.shards)
        a = np.frombuffer(seg.mm, np.float32, n, HEADER_BYTES)
        a[:] = np.arange(n, dtype=np.float32)
        monkeypatch.setattr(mapping, "SHARD_BYTES", 1 << 30)
        other = Segment.attach(name, HASH, rid)
        try:
            b = np.frombuffer(other.mm, np.float32, n, HEADER_BYTES)
            assert np.array_equal(a, b) and other.shards == seg.shards
            b[-1] = -1.0
            assert a[-1] == -1.0
            del b
        finally:
            other.close()
        del a
    assert leftovers(rid) == []
    dead = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from megatrain.ipc.shared import mapping, shm; mapping.SHARD_BYTES, mapping.ALIGN = 1 << 20, 1 << 16; "
            f"shm.Segment.create(shm.seg_name('{rid}', 'ctl'), 64, shm.Header({HASH!r}, '{rid}')); "
            f"shm.Segment.create(shm.seg_name('{rid}', 'params'), 3 << 20, shm.Header({HASH!r}, '{rid}'))",
        ],
        env=child_env(),
    )
    assert dead.returncode == 0 and len(leftovers(rid)) == 5
    segments.sweep(rid)
    assert leftovers(rid) == []


def test_a_missing_shard_is_a_layout_mismatch(rid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapping, "SHARD_BYTES", 1 << 20)
    monkeypatch.setattr(mapping, "ALIGN", 1 << 16)
    name = seg_name(rid, "params")
    with owned(Segment.create(name, 3 << 20, Header(HASH, rid))) as seg:
        posix_ipc.unlink_shared_memory(seg.shards[2])
        with pytest.raises(LayoutMismatch, match=r"shard .*params\.2 does not exist"):
            Segment.attach(name, HASH, rid)
    assert leftovers(rid) == []


@pytest.mark.parametrize(
    "owner_run, attach_hash, expect",
    [
        ("{rid}", bytes(16), ["layout hash differs"]),
        ("someoneelse", HASH, ["run id 'someoneelse'", "expected '{rid}'"]),
    ],
    ids=["wrong-layout-hash", "wrong-run-id"],
)
def test_attach_with_a_wrong_header_names_the_difference(
    rid: str, owner_run: str, attach_hash: bytes, expect: list[str]
) -> None:
    name = seg_name(rid, "ctl")
    with owned(Segment.create(name, 64, Header(HASH, owner_run.format(rid=rid)))):
        with pytest.raises(LayoutMismatch) as info:
            Segment.attach(name, attach_hash, rid)
        msg = str(info.value)
        assert name in msg and all(e.format(rid=rid) in msg for e in expect)
    assert leftovers(rid) == []


def test_only_the_owner_unlinks(rid: str) -> None:
    name = seg_name(rid, "params")
    with owned(Segment.create(name, 64, Header(HASH, rid))):
        other = Segment.attach(name, HASH, rid)
        try:
            with pytest.raises(RuntimeError, match=rf"segment {name}: only its owner \(pid {os.getpid()}\)"):
                other.unlink()
            assert leftovers(rid) == [f"megatrain-{rid}-params"]
        finally:
            other.close()
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


def test_check_space_counts_ram_outside_shm_against_ram_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's pinned checkpoints need RAM but no /dev/shm space; the refusal names them."""
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: 2**30)
    shm.check_space({"params": 2**29}, SHM, {"activation checkpoints": 2**28})
    with pytest.raises(ResourceError, match=r"activation checkpoints 0\.75 GiB.*but only 1\.00 GiB"):
        shm.check_space({"params": 2**29}, SHM, {"activation checkpoints": 3 * 2**28})
    monkeypatch.setattr(shm, "shm_free_bytes", lambda _d: 2**29 + 2**20)
    shm.check_space({"params": 2**29}, SHM, {"activation checkpoints": 2**28})  # fits /dev/shm, not counted there


def test_in_a_ray_worker_the_store_must_fit_under_the_memory_monitors_threshold(monkeypatch) -> None:
    """Ray's memory monitor kills a node's workers above a share of its RAM in use, shared memory included:
    a store the RAM holds but that threshold does not is refused with both numbers."""
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: 10 * 2**30)
    monkeypatch.setattr(shm, "mem_total_bytes", lambda: 20 * 2**30)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda _d: 20 * 2**30)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    shm.check_space({"params": 9 * 2**30}, SHM)  # no Ray here: RAM alone
    monkeypatch.setenv("RAY_RAYLET_PID", "1")
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    with pytest.raises(
        ResourceError,
        match=r"10\.00 GiB is available, but Ray's memory monitor kills .* above 90% "
        r".*leaves 8\.00 GiB for the run",
    ):
        shm.check_space({"params": 9 * 2**30}, SHM)
    shm.check_space({"params": 7 * 2**30}, SHM)
    monkeypatch.delenv("RAY_memory_usage_threshold")  # Ray's default, 95 %: 9 GiB left
    shm.check_space({"params": 9 * 2**30 - 2**20}, SHM)


# ---- the sweeper -------------------------------------------------------------------------------------


LIVE_OWNER = DEAD_OWNER + "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def test_sweep_removes_a_run_whose_owner_died(rid: str) -> None:
    cuda_file = None
    try:
        out = subprocess.run(
            [sys.executable, "-c", DEAD_OWNER, rid],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        pid = int(out.stdout.split()[0])
        expected = {f"megatrain-{rid}-ctl", f"megatrain-{rid}-params", f"sem.megatrain-{rid}-sem-wfree0"}
        assert set(leftovers(rid)) == expected
        owner = shm.read_owner(rid)
        assert owner is not None and owner[0] == pid and not procs.pid_alive(*owner)
        assert shm.read_worker_pids(rid) == [pid]
        # What the CUDA driver would leave for a SIGKILLed worker that the ctl segment names.
        cuda_file = f"{SHM}/cuda.shm.0.{pid:x}.1"
        open(cuda_file, "w").close()
        removed = segments.sweep(rid)
        assert set(removed) == expected | {os.path.basename(cuda_file)}
        assert leftovers(rid) == [] and not os.path.exists(cuda_file)
        assert segments.sweep(rid) == []  # idempotent
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
        assert shm.read_owner(rid) == (os.getpid(), procs.start_ticks(os.getpid()))
        assert segments.sweep(rid) == []
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
        hdr = Header(HASH, rid, os.getpid(), procs.start_ticks(os.getpid()) + 12345, 4096)
        ctl.mm[: len(hdr.pack())] = hdr.pack()
        assert not procs.pid_alive(os.getpid(), hdr.owner_ticks)
        assert segments.sweep(rid) == [f"megatrain-{rid}-ctl"]
        assert leftovers(rid) == []
    finally:
        ctl.unlink()
        ctl.close()
    assert leftovers(rid) == []


def test_sweep_spares_a_ctl_without_header_while_its_creator_holds_it_and_no_longer(rid: str) -> None:
    """A store being created: its ctl exists, without a header yet, open in its creator (shm_open, before
    mmap); then mapped, the descriptor closed. Spared both times, however old; gone once nothing holds it."""
    name = seg_name(rid, "ctl")
    raw = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    try:
        old = time.time() - 120
        os.utime(f"{SHM}/megatrain-{rid}-ctl", (old, old))
        assert shm.read_owner(rid) is None
        assert segments.sweep(rid) == []  # open
        mm = mmap.mmap(raw.fd, HEADER_BYTES)
        raw.close_fd()
        assert segments.sweep(rid) == []  # mapped
        mm.close()
        assert segments.sweep(rid) == [f"megatrain-{rid}-ctl"]
    finally:
        raw.close_fd()
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
    assert leftovers(rid) == []


# ---- the reaper ------------------------------------------------------------------------------------------


def start_reaper(rid: str, pid: int, ticks: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megatrain.ipc.shared.reaper", rid, str(pid), str(ticks)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=child_env(),
    )


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(timeout=10)


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "left-a-zombie"])
def test_reaper_unlinks_after_the_owner_is_sigkilled(rid: str, reaped: bool) -> None:
    """Reaped, as Ray's raylet does; or left a zombie, as where the raylet died first and the first process of
    a container is no init: a zombie runs no cleanup, ever."""
    owner = reaper = None
    try:
        owner = subprocess.Popen(
            [sys.executable, "-c", LIVE_OWNER, rid], stdout=subprocess.PIPE, text=True, env=child_env()
        )
        pid = int(owner.stdout.readline())
        assert owner.stdout.readline().strip() == "ready"
        assert len(leftovers(rid)) == 3
        reaper = start_reaper(rid, pid, procs.start_ticks(pid))
        # three of its looks with the owner alive (it sleeps between them): nothing may go
        assert sleeps_seen(reaper.pid, 3), f"the reaper exited with its owner alive: {reaper.communicate()}"
        assert len(leftovers(rid)) == 3
        owner.kill()
        if reaped:
            owner.wait(timeout=10)
        else:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
            assert procs.pid_alive(pid) and not procs.live(pid)
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
        reaper = start_reaper(rid, os.getpid(), procs.start_ticks(os.getpid()))
        assert sleeps_seen(reaper.pid, 2), reaper.communicate()  # watching: looked, found the owner, asleep again
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


def test_pss_of_this_process_and_of_a_gone_one(rid: str) -> None:
    assert shm.pss_split(os.getpid(), "x")[0] > 0
    assert shm.pss_split(2**31 - 7, "x") == (0, 0)
    with owned(shm.Segment.create(shm.seg_name(rid, "params"), 64 << 20, shm.Header(HASH, rid))) as seg:
        np.frombuffer(seg.mm, np.uint8)[:] = 1  # touch all 64 MiB: they count in PSS, outside the prefix only
        total, outside = shm.pss_split(os.getpid(), shm.seg_name(rid, ""))
        assert outside > 0 and total - outside >= 60 << 20
        # a prefix no mapping has: all of it outside, the segment too (one read: the rest of this process's
        # PSS moves between two reads, as other tests' processes come and go)
        every, beyond = shm.pss_split(os.getpid(), "no-such-mapping")
        assert beyond == every >= 60 << 20


# ---- processes by pid (megatrain.ipc.procs) ------------------------------------------------------------


def _kernel_start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat: the reference start_ticks must reproduce exactly (headers store it)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_start_ticks_and_started_at_are_the_kernels(rid: str) -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    after = time.time()
    try:
        # to a tick (10 ms), not to the second of the kernel's btime: a start-up is timed from it
        assert before - 0.02 <= procs.started_at(child.pid) <= after + 0.02, (before, after)
        for pid in (os.getpid(), child.pid):
            ticks = procs.start_ticks(pid)
            assert ticks == _kernel_start_ticks(pid) > 0
            assert procs.pid_alive(pid, ticks) and not procs.pid_alive(pid, ticks + 1)
            with open("/proc/stat") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            assert abs(procs.started_at(pid) - (btime + ticks / os.sysconf("SC_CLK_TCK"))) <= 1.0
        assert procs.start_ticks(2**31 - 7) == 0 and procs.started_at(2**31 - 7) == 0.0
    finally:
        child.communicate(b"")


def test_a_zombie_is_alive_but_not_running_and_maps_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped: a zombie
        assert procs.pid_alive(child.pid) and not procs.running(child.pid)
        assert not procs.maps_path(child.pid, "python")
    finally:
        child.wait()
    assert not procs.pid_alive(child.pid) and not procs.running(child.pid)


def test_a_stopped_process_is_stopped_until_continued() -> None:
    """What lets a failure's report skip the calls of an actor that cannot answer (launch/control/crew.py)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = procs.start_ticks(child.pid)
        assert not procs.stopped(child.pid, ticks)
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: procs.stopped(child.pid, ticks), 30)
        assert not procs.stopped(child.pid, ticks + 1)  # another process under a reused pid
        os.kill(child.pid, signal.SIGCONT)
        assert wait_until(lambda: not procs.stopped(child.pid, ticks), 30)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.communicate(b"")
    assert not procs.stopped(child.pid)


def test_maps_path_and_descendants(rid: str) -> None:
    name = seg_name(rid, "params")
    # a child with a grandchild; both end when their shared stdin closes
    tree = (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()']); "
        "print(c.pid, flush=True); c.wait()"
    )
    with owned(Segment.create(name, 4096, Header(HASH, rid))):
        assert procs.maps_path(os.getpid(), name) and not procs.maps_path(os.getpid(), f"megatrain-{rid}-nothing")
        child = subprocess.Popen([sys.executable, "-c", tree], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            grandchild = int(child.stdout.readline())
            assert {child.pid, grandchild} <= set(procs.descendants([os.getpid()]))
            assert procs.descendants([child.pid]) == [grandchild]
            assert not procs.maps_path(child.pid, name)
        finally:
            child.communicate("")
        assert not procs.maps_path(child.pid, name)  # gone


def test_fault_in_leaves_the_bytes_and_spreads_its_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces start one stretch apart (a thread per stretch); the bytes under them do not change."""
    assert hostmem.spread(list(range(10)), 3) == [0, 4, 8, 1, 5, 9, 2, 6, 3, 7]
    assert hostmem.spread([1, 2], 8) == [1, 2]
    monkeypatch.setattr(hostmem, "PIECE_BYTES", 1 << 16)
    a = np.arange(1 << 20, dtype=np.float32)
    done, pieces = hostmem.fault_in([(a.ctypes.data, a.nbytes)], 4)
    assert pieces == 64 and done in (0, 64) and np.array_equal(a, np.arange(1 << 20, dtype=np.float32))
    stop = threading.Event()
    stop.set()
    assert hostmem.fault_in([(a.ctypes.data, a.nbytes)], 4, stop) == (0, 64)  # a stop skips what is not begun
