"""A corrupt checkpoint is found before anything starts or changes (megatrain-launch's main() in this process,
the in-process runner): named explicitly it is refused, naming the intact one to resume from; with
train.resume: auto the run falls back to the newest intact one, loudly, and ends bit for bit where an
uninterrupted run ends. A run resumed at its end says it is complete and starts nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.formats import checkpoint as ckpt
from megatrain.launch.cli import main as cli
from megatrain.launch.control.runners import InProcessRunner, RayRunner
from tests.harness import TINY_DEFAULT

STEPS = 10


def args(out: Path, *extra: str) -> list[str]:
    return [
        *TINY_DEFAULT,
        "train.save_every=5",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.final_eval=false",
        "launch.runner=inprocess",
        f"train.output_dir={out}",
        *extra,
    ]


def tree(out: Path) -> dict[str, bytes]:
    """Every file under `out` with its bytes: what a refused launch must leave as it was."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting Ray or any actor fails the launch (it would be exit 1, not the refusal's 2)."""

    def started(*_a, **_k):
        raise AssertionError("Ray or an actor was started before the checkpoint was checked")

    monkeypatch.setattr(RayRunner, "connect", started)
    monkeypatch.setattr(InProcessRunner, "spawn", started)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run of STEPS steps with checkpoints after steps 5 and 10; each test works on a copy."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(args(out)) == 0
    assert [s for s, _ in ckpt.complete(out / "checkpoints")] == [5, 10]
    return out


def copy_of(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_an_explicit_corrupt_checkpoint_is_refused_naming_the_intact_one(
    finished: Path, tmp_path: Path, capsys, nothing_starts
) -> None:
    out = copy_of(finished, tmp_path / "run")
    bad, good = ckpt.step_dir(out / "checkpoints", 10), ckpt.step_dir(out / "checkpoints", 5)
    flip(bad / "host-0" / "exp_avg.bin", 100)
    (out / "metrics.jsonl").write_text("\n".join((out / "metrics.jsonl").read_text().splitlines()[:7]) + "\n")
    before = tree(out)
    capsys.readouterr()
    assert cli.main(args(out, f"train.resume={bad}", "train.steps=20")) == 2
    err = capsys.readouterr().err
    assert f"train.resume: {bad / 'host-0' / 'exp_avg.bin'} is corrupt: bytes 0-" in err, err
    assert "(unit 0, from tensor 'model.embed_tokens.weight')" in err, err
    assert f"resume from it with train.resume={good}" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "Error:" not in err, err
    assert tree(out) == before  # metrics not cut back, config.yaml not replaced, no error.log


def test_auto_falls_back_to_the_newest_intact_checkpoint_loudly_and_exactly(
    finished: Path, tmp_path: Path, capsys
) -> None:
    """The newest checkpoint is corrupt (as if the disk flipped a bit after it was written) and the run was
    stopped after it: resuming it redoes the steps from the intact one, ending where the run ended."""
    out = copy_of(finished, tmp_path / "run")
    root = out / "checkpoints"
    want = {p: (ckpt.step_dir(root, 10) / "host-0" / f"{p}.bin").read_bytes() for p in ckpt.PLANES}
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    flip(ckpt.step_dir(root, 10) / "host-0" / "params.bin", 5000)
    capsys.readouterr()
    assert cli.main(args(out)) == 0
    printed = capsys.readouterr().out
    assert f"WARNING: {ckpt.step_dir(root, 10) / 'host-0' / 'params.bin'} is corrupt" in printed, printed
    assert f"moved to {root / 'corrupt-step-0000010'}" in printed, printed
    assert f"resuming from the newest intact checkpoint, {ckpt.step_dir(root, 5)} (step 5)" in printed, printed
    assert (root / "corrupt-step-0000010").is_dir()  # kept for a look, never taken for a checkpoint
    assert [s for s, _ in ckpt.complete(root)] == [5, 10]
    assert not ckpt.verify(ckpt.step_dir(root, 10))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == losses  # steps 6..10 trained again, to the same losses
    # The redone step 10 is the uncorrupted one, bit for bit.
    assert {p: (ckpt.step_dir(root, 10) / "host-0" / f"{p}.bin").read_bytes() for p in ckpt.PLANES} == want


def test_auto_with_no_intact_checkpoint_is_refused(finished: Path, tmp_path: Path, capsys, nothing_starts) -> None:
    out = copy_of(finished, tmp_path / "run")
    for step in (5, 10):
        flip(ckpt.step_dir(out / "checkpoints", step) / "host-0" / "exp_avg_sq.bin", 7)
    before = tree(out)
    capsys.readouterr()
    assert cli.main(args(out, "train.steps=20")) == 2
    err = capsys.readouterr().err
    assert f"train.resume: auto: no checkpoint in {out / 'checkpoints'} is intact (2 corrupt" in err, err
    assert "train.resume=none with train.overwrite=true" in err and len(err.strip().splitlines()) == 1, err
    assert tree(out) == before


def test_a_truncated_file_is_refused_by_its_size(finished: Path, tmp_path: Path, capsys, nothing_starts) -> None:
    out = copy_of(finished, tmp_path / "run")
    bad = ckpt.step_dir(out / "checkpoints", 5) / "host-0" / "params.bin"
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size - 4096)
    capsys.readouterr()
    assert cli.main(args(out, f"train.resume={bad.parent.parent}", f"train.output_dir={tmp_path / 'new'}")) == 2
    err = capsys.readouterr().err
    assert f"{bad} has {size - 4096} bytes; its manifest says {size}" in err, err
    assert f"train.resume={ckpt.step_dir(out / 'checkpoints', 10)}" in err, err  # the intact one beside it
    assert not (tmp_path / "new").exists()  # a refused input creates nothing


def test_resuming_a_complete_run_says_so_and_starts_nothing(
    finished: Path, tmp_path: Path, capsys, nothing_starts
) -> None:
    out = copy_of(finished, tmp_path / "run")
    before = tree(out)
    capsys.readouterr()
    assert cli.main(args(out)) == 0
    printed = capsys.readouterr().out
    assert (
        f"megatrain-launch: nothing to do: the run is complete, its checkpoint "
        f"{ckpt.step_dir(out / 'checkpoints', 10)} is after step 10 of 10"
    ) in printed, printed
    assert tree(out) == before
