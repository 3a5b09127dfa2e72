"""Checkpoints and resume, through the in-process runner on the CPU in fp32: a run of 10 steps equals
5 steps + resume for 5, bit for bit (weights, Adam moments, per-step losses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from tests.data_fixtures import MODEL_VOCAB, chat_records, make_tokenizer, write_jsonl
from tests.harness import TINY, losses, planes
from tests.harness import train_tiny as run


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", []),
        ("qwen2", ["optim.max_grad_norm=0"]),
        ("mistral", ["ipc.staging=resident", "train.overlap_adam=false"]),
    ],
)
def test_resume_is_bit_identical(tmp_path: Path, family: str, extra: list[str]) -> None:
    run(tmp_path / "a", family, *extra)
    a = tmp_path / "a" / "checkpoints"
    assert [s for s, _ in ckpt.complete(a)] == [5, 10] and ckpt.latest(a) == ckpt.step_dir(a, 10)
    run(tmp_path / "b", family, *extra, f"train.resume={ckpt.step_dir(a, 5)}")
    assert planes(ckpt.step_dir(a, 10)) == planes(ckpt.step_dir(tmp_path / "b" / "checkpoints", 10))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(lb) == [6, 7, 8, 9, 10] and all(la[s] == lb[s] for s in lb)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_resume_on_shuffled_jsonl_is_bit_identical(tmp_path: Path, family: str) -> None:
    """Shuffled chat examples, 7 batches an epoch: the resumed half starts mid-epoch and crosses into the
    next epoch's permutation; losses, evaluation losses and the final planes equal the run's in one go."""
    tok = make_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(31))
    extra = [
        "data.kind=chat",
        f"data.path={data}",
        f"data.tokenizer={tok}",
        "data.seq_len=64",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.eval_fraction=0.1",
        "train.eval_every=4",
        f"model.hf.vocab_size={MODEL_VOCAB}",
    ]
    run(tmp_path / "a", family, *extra)
    run(tmp_path / "b", family, *extra, f"train.resume={ckpt.step_dir(tmp_path / 'a' / 'checkpoints', 5)}")
    rows = {
        k: {r["step"]: r for r in map(json.loads, (tmp_path / k / "metrics.jsonl").read_text().splitlines())}
        for k in "ab"
    }
    assert rows["a"][10]["epoch"] > 1 and sorted(rows["b"]) == [6, 7, 8, 9, 10]
    pick = lambda r: (r["loss"], r.get("eval_loss"))  # noqa: E731
    assert all(pick(rows["a"][s]) == pick(rows["b"][s]) for s in rows["b"])
    assert any("eval_loss" in r for r in rows["b"].values())
    assert planes(ckpt.step_dir(tmp_path / "a" / "checkpoints", 10)) == planes(
        ckpt.step_dir(tmp_path / "b" / "checkpoints", 10)
    )


def as_earlier_one_host_layout(directory: Path) -> None:
    """Rewrite a one-host checkpoint as the earlier format wrote it: the planes at the top of the step directory
    (no host-0/ part), a manifest without `hosts` or `slices` whose files are named at the top."""
    manifest = json.loads((directory / "manifest.json").read_text())
    for plane in ckpt.PLANES:
        (directory / "host-0" / f"{plane}.bin").rename(directory / f"{plane}.bin")
    shutil.rmtree(directory / "host-0")
    files = {
        name.removeprefix("host-0/"): {k: v for k, v in e.items() if k != "host"}
        for name, e in manifest["files"].items()
    }
    earlier = {k: v for k, v in manifest.items() if k not in ("hosts", "slices")}
    (directory / "manifest.json").write_text(json.dumps({**earlier, "files": files}, indent=1))


def test_a_checkpoint_of_the_earlier_one_host_layout_resumes_and_exports_exactly(tmp_path: Path) -> None:
    """One host writes a host-0/ part; a checkpoint written before it did (its planes at the top) is read as
    that one part: the run resumed from it is the run resumed from the same state in today's layout, bit for
    bit, and its export is the same model."""
    from megatrain.launch.cli import export_cmd

    run(tmp_path / "a", "llama")
    new = ckpt.step_dir(tmp_path / "a" / "checkpoints", 5)
    old = tmp_path / "old" / new.name
    shutil.copytree(new, old)
    as_earlier_one_host_layout(old)
    assert ckpt.verify(old) == "" and not (old / "host-0").exists() and "hosts" not in ckpt.manifest_of(old)
    run(tmp_path / "b", "llama", f"train.resume={old}")
    want = planes(ckpt.step_dir(tmp_path / "a" / "checkpoints", 10))
    assert planes(ckpt.step_dir(tmp_path / "b" / "checkpoints", 10)) == want
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(lb) == [6, 7, 8, 9, 10] and all(la[s] == lb[s] for s in lb)
    exported = [export_cmd.run(str(src), str(tmp_path / name))[0] for src, name in ((new, "hf-new"), (old, "hf-old"))]
    assert [(d / "model.safetensors").read_bytes() for d in exported] == [
        (exported[0] / "model.safetensors").read_bytes()
    ] * 2


def test_auto_resume_in_place_appends_metrics_and_ignores_torn_saves(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(out, "llama", steps=10)
    full = planes(ckpt.step_dir(out / "checkpoints", 10))
    ref = losses(out)
    # Back to the state of a run killed after step 7 while writing step 8's checkpoint.
    root = out / "checkpoints"
    for s, p in ckpt.complete(root):
        if s == 10:
            shutil.rmtree(p)
    (root / "latest").write_text("step-0000010\n")  # names a checkpoint that is gone: not trusted
    (root / "step-0000008.tmp-4242").mkdir()
    (root / "step-0000008.tmp-4242" / "params.bin").write_bytes(b"torn")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:7]) + "\n")
    run(out, "llama", steps=10)  # train.resume: auto
    assert losses(out) == ref and planes(ckpt.step_dir(root, 10)) == full
    assert not list(root.glob("*.tmp-*"))


def test_an_unfinished_write_a_killed_run_left_is_removed_at_the_next_start_and_said(tmp_path: Path, capsys) -> None:
    """A run over several hosts killed while writing leaves every host's part in step-N.tmp-hosts, a checkpoint's
    size on the disk: the next run in the directory removes it before it starts, with a line, even one that
    writes no checkpoint itself (the writers' own clean-up never runs there)."""
    out = tmp_path / "run"
    torn = out / "checkpoints" / "step-0000004.tmp-hosts"
    for part in ("host-0", "host-1.tmp-4242"):
        (torn / part).mkdir(parents=True)
        (torn / part / "params.bin").write_bytes(b"torn")
    run(out, "llama", "train.save_every=0", "train.save_final=false", steps=2)
    assert not torn.exists() and not list((out / "checkpoints").glob("*.tmp-*"))
    said = capsys.readouterr().out
    assert f"removed step-0000004.tmp-hosts from {out / 'checkpoints'}: an earlier run's checkpoint write" in said


def test_resume_refuses_another_model_and_a_corrupt_file(tmp_path: Path) -> None:
    run(tmp_path / "a", "llama", steps=5)
    step5 = ckpt.step_dir(tmp_path / "a" / "checkpoints", 5)
    hf = json.dumps({**TINY, "num_hidden_layers": 3, "hidden_size": 64})
    with pytest.raises(ConfigError, match=r"holds another model: tensor 'model.embed_tokens.weight'"):
        run(tmp_path / "b", "llama", f"model.hf={hf}", f"train.resume={step5}")
    data = bytearray((step5 / "host-0" / "exp_avg.bin").read_bytes())
    data[100] ^= 0xFF
    (step5 / "host-0" / "exp_avg.bin").write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"exp_avg.bin is corrupt"):
        run(tmp_path / "c", "llama", f"train.resume={step5}")


def test_keep_last_prunes_after_a_new_one_is_complete(tmp_path: Path) -> None:
    run(tmp_path / "a", "llama", "train.keep_last=1", steps=10)
    assert [s for s, _ in ckpt.complete(tmp_path / "a" / "checkpoints")] == [10]


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_is_exact(tmp_path: Path) -> None:
    """SIGTERM to this process while megatrain-launch's main() runs here: the step in flight finishes, a
    checkpoint is written (no save_every needed), exit 143; running the same command again resumes and
    ends where the uninterrupted run ends, bit for bit."""
    import os
    import signal
    import threading

    from megatrain.launch.cli import main as cli

    run(tmp_path / "ref", "llama", steps=8)
    out = tmp_path / "run"
    args = [
        str(Path(__file__).parents[1] / "examples/default.yaml"),
        "model.family=llama",
        f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 3, 'tie_word_embeddings': False})}",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.ops=+-*",
        "data.loss_on=all",
        "optim.lr=2e-3",
        "optim.weight_decay=0.1",
        "optim.warmup_steps=2",
        "optim.schedule=cosine",
        "optim.min_lr_ratio=0.1",
        "train.steps=8",
        "train.eval_every=0",
        "train.log_every=1",
        "train.save_every=100",
        f"train.output_dir={out}",
        "launch.runner=inprocess",
    ]
    metrics = out / "metrics.jsonl"

    def kill_after_step_3() -> None:
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_after_step_3, daemon=True).start()
    assert cli.main(args) == 128 + signal.SIGTERM
    stopped = ckpt.complete(out / "checkpoints")
    assert len(stopped) == 1 and 3 <= stopped[0][0] < 8
    assert cli.main(args) == 0
    assert [s for s, _ in ckpt.complete(out / "checkpoints")] == [stopped[0][0], 8]  # 8: the end's
    assert losses(out) == losses(tmp_path / "ref")
    assert planes(ckpt.step_dir(out / "checkpoints", 8)) == planes(ckpt.step_dir(tmp_path / "ref" / "checkpoints", 8))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_the_first_signal_asks_the_second_insists(sig: str) -> None:
    import signal

    from megatrain.launch.run.stopping import StopRequest

    stop, num = StopRequest(), getattr(signal, sig)
    with stop.installed():
        assert signal.getsignal(num) == stop._handle
        stop._handle(num, None)
        assert stop.signum == num and stop.name == sig  # the CLI exits 128 + signum after the checkpoint
        with pytest.raises(KeyboardInterrupt):
            stop._handle(num, None)
    assert signal.getsignal(num) != stop._handle  # restored


def test_threads_refused_o_direct_together_all_fall_back_to_buffered_writes(tmp_path: Path, monkeypatch) -> None:
    """Two threads' O_DIRECT writes are both refused (an unaligned chunk, as a host's slice can be) before either
    turns O_DIRECT off: both go on buffered, and the file holds both chunks with their CRCs."""
    import errno
    import fcntl
    import os
    import threading
    import zlib

    import numpy as np

    real, both_refused = os.pwrite, threading.Barrier(2, timeout=10)

    def pwrite(fd: int, data, pos: int) -> int:  # noqa: ANN001
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            both_refused.wait()
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, pos)

    monkeypatch.setattr(ckpt.os, "pwrite", pwrite)
    pf = ckpt.PlaneFile(tmp_path / "plane.bin", 64)
    if not pf.direct:
        pytest.skip("this filesystem refuses O_DIRECT at open")
    data = [np.full(32, i + 1, np.uint8) for i in range(2)]
    out: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, pf.write(data[i], 32 * i))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pf.close()
    assert out == [[32 * i, 32, zlib.crc32(data[i])] for i in range(2)] and not pf.direct
    assert (tmp_path / "plane.bin").read_bytes() == bytes([1] * 32 + [2] * 32)
