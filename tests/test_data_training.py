"""Training on the user's data through the actor system: every format end to end, the documented order
and masks as the run sees them, and the match with plain PyTorch (per-step loss, final weights, eval loss)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.launch.cli import main as cli
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.config.tree import load_config
from tests.data_fixtures import (
    MODEL_VOCAB,
    chat_records,
    make_tokenizer,
    prompt_completion_records,
    text_records,
    write_jsonl,
)
from tests.data_fixtures import data_overrides as overrides
from tests.harness import check_match, started_since


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def hand_windows(tok_dir: Path, records: list[dict], L: int, B: int):
    """Batch t of an unshuffled text run, built by hand: documents + EOS joined, windows of L, B per batch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    stream: list[int] = []
    for r in records:
        stream += tok(r["text"])["input_ids"] + [tok.eos_token_id]

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([stream[w * L : (w + 1) * L] for w in range(t * B, (t + 1) * B)])
        return ids, ids.clone()

    return batch


def test_text_run_sees_the_documented_windows_and_matches_plain_pytorch(tmp_path, tok_dir) -> None:
    """shuffle off: the reference trains on windows cut by hand from the joined documents, so equal
    per-step losses mean the run consumed exactly those windows; eval on a held-out tenth."""
    recs = text_records(80)
    path = write_jsonl(tmp_path / "t.jsonl", recs)
    cfg = load_config(
        None,
        overrides(
            "llama",
            tmp_path,
            tok_dir,
            [
                "data.kind=text",
                f"data.path={path}",
                "data.shuffle=false",
                "data.eval_fraction=0.1",
                "train.eval_every=5",
            ],
        ),
    )
    rep = compare(cfg, tmp_path, batches=hand_windows(tok_dir, recs, 32, 4))
    check_match(rep)
    rows = rep["summary"].metrics
    assert [("eval_loss" in r) for r in rows] == [s in (5, 10) for s in range(1, 11)]
    assert rows[-1]["eval_ppl"] == pytest.approx(np.exp(rows[-1]["eval_loss"]))
    per_epoch = 129 // 4  # 143 windows, the last 14 held out, 4 per batch
    assert [r["epoch"] for r in rows] == [round(s / per_epoch, 4) for s in range(1, 11)]


@pytest.mark.parametrize("family, staging", [("qwen2", "slabs"), ("mistral", "resident")])
def test_chat_run_matches_plain_pytorch(tmp_path, tok_dir, family: str, staging: str) -> None:
    """Shuffled, padded chat with a separate eval file; the eval walk in both staging modes."""
    train = write_jsonl(tmp_path / "train.jsonl", chat_records(60))
    held = write_jsonl(tmp_path / "eval.jsonl", chat_records(10, seed=77))
    cfg = load_config(
        None,
        overrides(
            family,
            tmp_path,
            tok_dir,
            [
                "data.kind=chat",
                f"data.path={train}",
                f"data.eval_path={held}",
                f"ipc.staging={staging}",
                "data.seq_len=96",
                "actors.num_packers=2",
                "ipc.weight_slabs=3",
                "ipc.slab_params=3000",
            ],
        ),
    )
    rep = compare(cfg, tmp_path)
    check_match(rep)
    assert rep["summary"].metrics[-1]["eval_tokens"] > 0


@pytest.mark.slow
def test_chat_through_ray_matches_plain_pytorch(ray_cluster, tmp_path, tok_dir) -> None:
    """The same through one OS process per actor (packers packing the evaluation walks included)."""
    train = write_jsonl(tmp_path / "train.jsonl", chat_records(60))
    cfg = load_config(
        None,
        overrides(
            "llama",
            tmp_path,
            tok_dir,
            ["data.kind=chat", f"data.path={train}", "data.eval_fraction=0.1", "train.eval_every=4", "data.seq_len=96"],
            runner="ray",
        ),
    )
    check_match(compare(cfg, tmp_path))


# ---- every format through the launcher -------------------------------------------------------------
def _launch(tmp_path: Path, tok_dir: Path, data: list[str], steps: int = 4) -> tuple[int, list[dict]]:
    args = overrides("llama", tmp_path, tok_dir, data, steps=steps)
    rc = cli.main([str(_empty_yaml(tmp_path)), *args])
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if rc == 0 else []
    return rc, [json.loads(x) for x in lines]


def _empty_yaml(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  log_every: 1\n")
    return p


def test_prompt_completion_with_epochs(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", prompt_completion_records(12))
    rc, rows = _launch(
        tmp_path,
        tok_dir,
        ["data.kind=prompt_completion", f"data.path={path}", "data.epochs=2", "data.eval_fraction=0.25"],
        steps=99,
    )
    assert rc == 0 and len(rows) == 4  # 9 training examples: 2 batches of 4 per epoch
    assert [r["epoch"] for r in rows] == [0.5, 1.0, 1.5, 2.0]
    assert "eval_loss" in rows[-1] and all(np.isfinite(r["loss"]) for r in rows)


def test_packed_chat_and_token_files(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(30))
    rc, rows = _launch(tmp_path, tok_dir, ["data.kind=chat", f"data.path={path}", "data.packing=true"])
    assert rc == 0 and len(rows) == 4 and rows[0]["tokens"] < 4 * 32  # only assistant tokens carry labels
    tokens = (np.arange(5000) * 13 % MODEL_VOCAB).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    rc, rows = _launch(
        tmp_path / "tok", tok_dir, ["data.kind=tokens", f"data.path={tmp_path / 't.bin'}", "data.eval_fraction=0.05"]
    )
    assert rc == 0 and len(rows) == 4 and rows[0]["tokens"] == 4 * 31 and "eval_loss" in rows[-1]


@pytest.mark.parametrize(
    "problem, words, runner",
    [
        ("missing", "data.path: file '", "ray"),
        ("bad-line", "t.jsonl:3: not valid JSON", "inprocess"),
    ],
)
def test_bad_data_exits_2_with_one_line_and_leaves_nothing(
    tmp_path, tok_dir, capsys, monkeypatch, problem: str, words: str, runner: str
) -> None:
    """With Ray the data is read beside its start and the actors' spawn (launch/prepare/inputs.py): the refusal ends
    them again, and nothing of the run is left. In-process nothing is spawned before the data is read."""
    import psutil

    from megatrain.launch.control.runners import InProcessRunner

    def no_spawn(*_):
        raise AssertionError("an actor was spawned before the data was checked")

    monkeypatch.setattr(InProcessRunner, "spawn", no_spawn)
    path = tmp_path / "t.jsonl"
    if problem == "bad-line":
        write_jsonl(path, text_records(2))
        with open(path, "a") as f:
            f.write("{oops\n")
    args = overrides("llama", tmp_path, tok_dir, ["data.kind=text", f"data.path={path}"], runner=runner)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rc = cli.main([str(_empty_yaml(tmp_path)), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not started_since(before)
    assert not (tmp_path / "out").exists()  # the output directory was never made


def test_the_readme_own_data_example_runs(tmp_path) -> None:
    """examples/make_own_data.py + examples/own-data.yaml, as the README gives them (fewer steps)."""
    import subprocess
    import sys

    from tests.harness import ROOT

    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_own_data.py"), str(tmp_path), "--conversations", "300"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    rc = cli.main(
        [
            str(ROOT / "examples" / "own-data.yaml"),
            f"model.pretrained={tmp_path / 'model'}",
            f"data.path={tmp_path / 'chat.jsonl'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=4",
            "train.eval_every=2",
            f"train.output_dir={tmp_path / 'run'}",
            "launch.runner=inprocess",
        ]
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rc == 0 and len(rows) == 4 and "eval_loss" in rows[1] and "eval_loss" in rows[3]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
