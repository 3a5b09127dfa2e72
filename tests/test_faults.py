"""Faults through the in-process runner (every actor a thread of this process, the real store, waits
and monitor): the failing actor is named, the run stops promptly, nothing is left in /dev/shm."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
import torch

from megatrain.errors import MegatrainError
from megatrain.ipc.shared.shm import host_run_id
from tests.harness import run_leftovers
from tests.harness import train_small as run


def test_an_actor_that_raises_is_named_with_its_error(tmp_path, rid: str, monkeypatch) -> None:
    import megatrain.actors.packer as packer

    real, raised_at = packer.pack, []

    def pack(store, item, step):  # noqa: ANN001
        if step == 2:
            raised_at.append(time.monotonic())
            raise RuntimeError("boom in the packer")
        real(store, item, step)

    monkeypatch.setattr(packer, "pack", pack)
    with pytest.raises(MegatrainError, match=r"actor 'packer-0'.*RuntimeError: boom in the packer") as info:
        run(tmp_path, rid)
    # from the raise, not from the start (a busy machine's start-up is not the point): far below any wait's
    # timeout (ipc.wait_timeout_s, 600 s), which a run that missed the failure would run into
    assert time.monotonic() - raised_at[0] < 60
    assert "boom in the packer" in info.value.traceback and "pack" in info.value.traceback  # the actor's own stack
    assert run_leftovers(rid) == []


def test_a_stalled_actor_is_named_not_its_victims(tmp_path, rid: str, monkeypatch) -> None:
    """Adam hangs inside its own work (not in a data-plane wait): the monitor names it from the role
    table's progress, long before any wait timeout, and the run ends right after the verdict (the driver does
    not wait on the stalled actor's answer, which never comes)."""
    from megatrain.actors.adam_updater import AdamUpdater

    release, hang_over = threading.Event(), threading.Event()
    real = AdamUpdater._update

    def update(self, unit, lo, hi, g, t, lr, scale, spare=False):  # noqa: ANN001
        if t == 2:
            release.wait(60)  # a hang the run must notice; freed once the run has ended
            hang_over.set()
        real(self, unit, lo, hi, g, t, lr, scale, spare)

    monkeypatch.setattr(AdamUpdater, "_update", update)
    try:
        with pytest.raises(MegatrainError) as info:
            run(tmp_path, rid, "ipc.stall_timeout_s=2", "train.overlap_adam=false")
        # A condition, not a clock: a driver that waited for the stalled call's answer could only end once the
        # hang did (its 60 s out), so the run must have ended with Adam still hung.
        assert not hang_over.is_set(), "the run ended only after the stalled actor's hang did"
    finally:
        release.set()
    msg = str(info.value)
    assert "stalled: actor 'adam-updater'" in msg and "while working" in msg, msg  # the monitor's, not a timeout
    assert run_leftovers(rid) == []


def test_a_wait_timeout_names_what_was_awaited(tmp_path, rid: str, monkeypatch) -> None:
    import megatrain.actors.packer as packer

    release = threading.Event()
    real = packer.pack

    def pack(store, item, step):  # noqa: ANN001
        if step == 1:
            release.wait(30)
        real(store, item, step)

    monkeypatch.setattr(packer, "pack", pack)
    try:
        # The executor (weights of unit 0), or Adam and the accumulator downstream of it, whichever times
        # out first: each names what it waited for (naming the culprit is the monitor's job, off here).
        with pytest.raises(MegatrainError, match=r"WaitTimeout: waited 1s for (weights of unit 0|the gradient)"):
            run(tmp_path, rid, "ipc.wait_timeout_s=1", "ipc.stall_timeout_s=0")
    finally:
        release.set()
    assert run_leftovers(rid) == []


def _poison(monkeypatch, at_step: int) -> None:
    """The executor's gradient of layer 0 (unit 1) gets a NaN in step `at_step` (1-based)."""
    from megatrain.actors.executor.streams import SyncSink

    real, seen = SyncSink.emit, {"n": 0}

    def emit(self, unit: int, grad: torch.Tensor) -> None:  # noqa: ANN001
        if unit == 1:
            seen["n"] += 1
            if seen["n"] == at_step:
                grad = grad.clone()
                grad[3] = math.nan
        real(self, unit, grad)

    monkeypatch.setattr(SyncSink, "emit", emit)


def test_non_finite_gradient_with_clipping_skips_the_step_whole(tmp_path, rid: str, monkeypatch) -> None:
    _poison(monkeypatch, at_step=2)
    rows = run(tmp_path, rid, "optim.max_grad_norm=1.0", "train.save_final=true").metrics
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert not math.isfinite(rows[1]["grad_norm"]) and all(math.isfinite(r["loss"]) for r in rows)


def test_non_finite_gradient_without_clipping_stops_naming_step_and_unit(tmp_path, rid: str, monkeypatch) -> None:
    _poison(monkeypatch, at_step=3)
    with pytest.raises(MegatrainError, match=r"non-finite gradient \(inf or NaN\) at step 3 in unit 1 \(layer 0\)"):
        run(tmp_path, rid, "optim.max_grad_norm=0")
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] or [r["step"] for r in rows] == [1, 2]  # never a half-applied step
    assert run_leftovers(rid) == []


def test_an_actor_that_raises_on_host_1_is_named_with_its_host(tmp_path, rid: str, monkeypatch) -> None:
    """Over two hosts (simulated in this process) host 1's Adam raises: it is named with its host, whatever
    its failure made of the others (host 0 aborted by the driver, the executors' collective broken), and those
    are its consequences (error.log lists them)."""
    from megatrain.actors.adam_updater import AdamUpdater

    real = AdamUpdater._update

    def update(self, unit, lo, hi, g, t, lr, scale, spare=False):  # noqa: ANN001
        if t == 2 and self.store.spec.host == 1:
            raise RuntimeError("boom on host 1")
        real(self, unit, lo, hi, g, t, lr, scale, spare)

    monkeypatch.setattr(AdamUpdater, "_update", update)
    with pytest.raises(MegatrainError) as info:
        run(tmp_path, rid, "actors.num_hosts=2", "engine.device=cpu")
    named = r"actor 'adam-updater@host1' \(pid \d+, node [^)]+\) failed: RuntimeError: boom on host 1"
    assert re.fullmatch(named, str(info.value)), info.value
    assert "boom on host 1" in info.value.traceback  # the actor's own stack
    caused = info.value.consequences
    assert any("adam-updater@host1: RuntimeError: boom on host 1" in line for line in caused), caused
    assert all("boom" not in line or "run aborted" in line for line in caused), caused  # the root once
    assert run_leftovers(rid) == [] and run_leftovers(host_run_id(rid, 1)) == []
