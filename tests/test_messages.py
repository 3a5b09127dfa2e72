"""The cross-process messages (ipc/messages.py): several executors' step reports merge field by field
by their rules (the step's loss, tokens and bytes are the sum of the executors' parts, its times and GPU peak
the slowest's, the whole-batch statistics executor 0's); every message is frozen and keyword-only, and one
survives pickling as Ray sends it."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import torch

from megatrain.errors import ProtocolError
from megatrain.ipc import messages
from megatrain.ipc.messages import Applied, StepReport, StepRequest
from tests.harness import heavy_after

SUMMED = ("loss", "tokens", "h2d_bytes", "d2h_bytes", "gpu_units")
SLOWEST = (
    "compute_s",
    "weight_wait_s",
    "grad_wait_s",
    "forward_s",
    "head_s",
    "backward_s",
    "gpu_peak_bytes",
    "gpu_update_s",
)
EXECUTOR_0 = ("aux_loss", "expert_load", "timeline", "profile")


def _report(k: int, value: int) -> StepReport:
    """Executor k's report: every numeric field `value`, the per-executor statistics tagged with k."""
    numbers = {name: value for name in SUMMED + SLOWEST}
    return StepReport(
        **numbers,
        aux_loss=0.25 + k,
        expert_load=[[k, k]],
        timeline={"wall0": float(k)},
        profile={"profile_trace": f"trace-{k}.json"},
    )


@pytest.mark.parametrize("values", [(1, 5), (1, 5, 3)])
def test_merge_follows_each_fields_rule(values: tuple[int, ...]) -> None:
    merged = StepReport.merge([_report(k, v) for k, v in enumerate(values)])
    for name in SUMMED:
        assert getattr(merged, name) == sum(values), name
    for name in SLOWEST:
        assert getattr(merged, name) == max(values), name
    first = _report(0, values[0])
    for name in EXECUTOR_0:
        assert getattr(merged, name) == getattr(first, name), name
    assert merged.executor_compute_s == values
    covered = set(SUMMED + SLOWEST + EXECUTOR_0) | {"executor_compute_s"}
    assert covered == {f.name for f in dataclasses.fields(StepReport)}  # a new field needs its rule here


def test_one_executor_is_the_step_and_an_unmeasured_peak_stays_unmeasured() -> None:
    one = _report(0, 2)
    assert StepReport.merge([one]) is one and one.executor_compute_s is None
    cpu = [dataclasses.replace(_report(k, 2), gpu_peak_bytes=None) for k in range(2)]
    assert StepReport.merge(cpu).gpu_peak_bytes is None
    with pytest.raises(ProtocolError, match="no executor"):
        StepReport.merge([])


def test_the_row_keeps_the_field_order_and_leaves_out_what_is_not_set() -> None:
    part = dataclasses.replace(
        _report(0, 1), aux_loss=None, expert_load=None, gpu_peak_bytes=None, gpu_units=None, gpu_update_s=None
    )
    row = StepReport.merge([part, part]).row()
    assert list(row) == [
        "loss",
        "tokens",
        "compute_s",
        "weight_wait_s",
        "grad_wait_s",
        "h2d_bytes",
        "d2h_bytes",
        "forward_s",
        "head_s",
        "backward_s",
        "timeline",
        "profile_trace",  # the profile's own keys, in its place
        "executor_compute_s",
    ]
    assert row["executor_compute_s"] == [1, 1] and row["profile_trace"] == "trace-0.json"


def _messages() -> list[type]:
    return [
        cls
        for _, cls in inspect.getmembers(messages, inspect.isclass)
        if cls.__module__ == messages.__name__ and dataclasses.is_dataclass(cls)
    ]


def test_every_message_is_frozen_and_keyword_only() -> None:
    found = _messages()
    assert {StepRequest, StepReport, Applied} <= set(found)
    for cls in found:
        assert cls.__dataclass_params__.frozen, cls.__name__
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls.__name__
        with pytest.raises(TypeError):
            cls(*range(len(dataclasses.fields(cls))))  # by position: refused
    applied = Applied(grad_norm=1.0, clip_scale=1.0, skipped=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        applied.adam_s = 2.0  # type: ignore[misc]


def test_the_messages_load_without_the_training_stack() -> None:
    """The launcher's light paths name these types: importing them loads no torch, numba or modeling code."""
    assert heavy_after("import megatrain.ipc.messages") == []


def test_messages_round_trip_through_pickle() -> None:
    request = StepRequest(step=3, ids=torch.arange(6).view(2, 3), labels=torch.ones(2, 3, dtype=torch.long))
    back = pickle.loads(pickle.dumps(request))
    assert back.step == 3 and torch.equal(back.ids, request.ids) and torch.equal(back.labels, request.labels)
    assert back.positions is None and back.profile == "" and not back.timeline
    report = StepReport.merge([_report(0, 1), _report(1, 4)])
    assert pickle.loads(pickle.dumps(report)) == report
    applied = Applied(grad_norm=2.5, clip_scale=0.4, skipped=False, unit_spans=((1, 0.5, 0.75),), adam_s=0.1)
    assert pickle.loads(pickle.dumps(applied)) == applied
