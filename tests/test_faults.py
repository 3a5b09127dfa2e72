"""Faults through the in-process runner (every actor a thread of this process, the real store, waits
and monitor): the failing actor is named, the run stops promptly, nothing is left in /dev/shm."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from megatrain.launch.config import load_config
from megatrain.launch.driver import Trainer

from megatrain.errors import MegatrainError
from tests.conftest import run_leftovers
from tests.helpers import TINY

HF = json.dumps({**TINY, "num_hidden_layers": 2, "tie_word_embeddings": False})


def run(tmp_path, rid: str, *extra: str, steps: int = 4) -> dict:
    cfg = load_config(None, [f"model.hf={HF}", "data.seq_len=32", "data.batch_size=2", f"train.steps={steps}",
                             f"train.run_id={rid}", f"train.output_dir={tmp_path / 'out'}", "launch.runner=inprocess",
                             "ipc.poll_s=0.02", *extra])
    return Trainer(cfg).run()


def test_an_actor_that_raises_is_named_with_its_error(tmp_path, rid: str, monkeypatch) -> None:
    import megatrain.actors.packer as packer

    real, calls = packer.pack, []

    def pack(store, item, step):  # noqa: ANN001
        calls.append(step)
        if step == 2:
            raise RuntimeError("boom in the packer")
        real(store, item, step)

    monkeypatch.setattr(packer, "pack", pack)
    t0 = time.monotonic()
    with pytest.raises(MegatrainError, match=r"actor 'packer-0'.*RuntimeError: boom in the packer") as info:
        run(tmp_path, rid)
    assert time.monotonic() - t0 < 20
    assert "boom in the packer" in info.value.traceback and "pack" in info.value.traceback  # the actor's own stack
    assert run_leftovers(rid) == []


def test_a_stalled_actor_is_named_not_its_victims(tmp_path, rid: str, monkeypatch) -> None:
    """Adam hangs inside its own work (not in a data-plane wait): the monitor names it from the role
    table's progress, long before any wait timeout, and the run ends right after the verdict (the driver does
    not wait on the stalled actor's answer, which never comes)."""
    from megatrain.actors.adam_updater import AdamUpdater
    from megatrain.ipc.protocol.store import Store

    release = threading.Event()
    real, real_abort, verdict_at = AdamUpdater._update, Store.abort, []

    def update(self, unit, lo, hi, g, t, lr, scale):  # noqa: ANN001
        if t == 2:
            release.wait(60)  # a hang the run must notice; freed at the end so the thread can finish
        real(self, unit, lo, hi, g, t, lr, scale)

    def abort(self, reason: str) -> None:  # noqa: ANN001 - the real abort, timed
        if reason.startswith("stalled:") and not verdict_at:
            verdict_at.append(time.monotonic())
        real_abort(self, reason)

    monkeypatch.setattr(AdamUpdater, "_update", update)
    monkeypatch.setattr(Store, "abort", abort)
    t0 = time.monotonic()
    try:
        with pytest.raises(MegatrainError) as info:
            run(tmp_path, rid, "ipc.stall_timeout_s=2", "train.overlap_adam=false")
        ended = time.monotonic()
    finally:
        release.set()
    msg = str(info.value)
    assert "stalled: actor 'adam-updater'" in msg and "while working" in msg, msg
    assert ended - t0 < 20, ended - t0
    assert verdict_at and ended - verdict_at[0] < 3, f"the run ended {ended - verdict_at[0]:.1f}s after the verdict"
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
    from megatrain.ipc.protocol.executor import SyncSink

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
    rows = run(tmp_path, rid, "optim.max_grad_norm=1.0", "train.save_final=true")["metrics"]
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert not math.isfinite(rows[1]["grad_norm"]) and all(math.isfinite(r["loss"]) for r in rows)


def test_non_finite_gradient_without_clipping_stops_naming_step_and_unit(tmp_path, rid: str, monkeypatch) -> None:
    _poison(monkeypatch, at_step=3)
    with pytest.raises(MegatrainError, match=r"non-finite gradient \(inf or NaN\) at step 3 in unit 1 \(layer 0\)"):
        run(tmp_path, rid, "optim.max_grad_norm=0")
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] or [r["step"] for r in rows] == [1, 2]  # never a half-applied step
    assert run_leftovers(rid) == []
