"""`megatrain-launch tokenizer`: a tokenizer made here from the user's own files, which AutoTokenizer loads and a
run trains with; bad input is one line and exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatrain.launch.cli.main import main
from megatrain.launch.config.tree import load_config
from megatrain.launch.run.driver import Trainer
from tests.data_fixtures import chat_records, text_records, write_jsonl
from tests.harness import TINY


def test_a_tokenizer_from_own_files_loads_round_trips_and_trains(tmp_path: Path, rid: str, capsys) -> None:
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"body": r["text"]} for r in text_records(300)])
    chats = write_jsonl(tmp_path / "chat.jsonl", chat_records(50))
    (tmp_path / "notes.txt").write_text("naïve café — 東京 🙂\nplain text lines too\n" * 20)
    tok_dir = tmp_path / "tok"
    assert (
        main(
            [
                "tokenizer",
                str(docs),
                str(chats),
                str(tmp_path / "*.txt"),
                "--out",
                str(tok_dir),
                "--vocab-size",
                "400",
                "--text-key",
                "body",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert f"wrote {tok_dir}" in said and f"data.tokenizer={tok_dir}" in said and "3 file(s)" in said

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert 259 < len(tok) <= 400 and f"model.hf.vocab_size >= {len(tok)}" in said
    # The end of text is a special token of its own (id 0), also BOS and padding: what a run and export take.
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == ("<|endoftext|>", 0, 0, 0)
    text = "the quick dog — naïve café, 東京 🙂 unseen: Zyzzyva"  # bytes never seen in training encode too
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and 0 not in ids and len(ids) < len(text.encode())  # merges learned
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )

    # A few steps of a fresh model on the user's text, with that tokenizer (data.kind text).
    hf = json.dumps({**TINY, "num_hidden_layers": 2, "vocab_size": len(tok)})
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.kind=text",
            f"data.path={docs}",
            "data.text_field=body",
            f"data.tokenizer={tok_dir}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=3",
            f"train.run_id={rid}",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
        ],
    )
    summary = Trainer(cfg).run()
    losses = [r["loss"] for r in summary.metrics]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(len(tok)), rel=0.1)  # a fresh model: about uniform over the vocab


@pytest.mark.parametrize(
    "make, args, says",
    [
        (None, ["missing.jsonl"], "'{tmp}/missing.jsonl' does not exist"),
        (None, ["*.nothing"], "no file matches '{tmp}/*.nothing'"),
        ("bad.jsonl", ["bad.jsonl"], "{tmp}/bad.jsonl:2: not valid JSON"),
        ("nokey.jsonl", ["nokey.jsonl"], "{tmp}/nokey.jsonl:1: no text: no string field 'text' (--text-key)"),
        ("latin1.txt", ["latin1.txt"], "{tmp}/latin1.txt:2: not valid UTF-8"),
        ("ids.npy", ["ids.npy"], "'{tmp}/ids.npy' holds token ids (data.kind tokens), not text"),
        ("docs.jsonl", ["docs.jsonl", "--vocab-size", "100"], "--vocab-size 100 is below 259"),
        ("docs.jsonl", ["docs.jsonl", "--out", "{tmp}/full"], "--out '{tmp}/full' is not empty"),
        ("docs.jsonl", ["docs.jsonl", "--vocab", "x"], "argument --vocab-size: invalid int value: 'x'"),
        (None, [], "the following arguments are required: data"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, make: str | None, args: list[str], says: str) -> None:
    files = {
        "bad.jsonl": '{"text": "fine"}\n{"text": broken\n',
        "nokey.jsonl": '{"body": "x"}\n',
        "latin1.txt": "fine\n",
        "docs.jsonl": '{"text": "a document"}\n',
    }
    if make == "ids.npy":
        np.save(tmp_path / make, np.arange(10, dtype=np.uint16))
    elif make == "latin1.txt":
        (tmp_path / make).write_bytes(b"fine\ncaf\xe9\n")
    elif make:
        (tmp_path / make).write_text(files[make])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "tokenizer.json").write_text("{}")
    argv = [
        a.replace("{tmp}", str(tmp_path))
        if a.startswith("{tmp}")
        else (str(tmp_path / a) if not a.startswith("-") and not a.isdigit() and a != "x" else a)
        for a in args
    ]
    if "--out" not in argv and argv:
        argv += ["--out", str(tmp_path / "tok")]
    assert main(["tokenizer", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-launch: error: tokenizer: "), err
    assert says.replace("{tmp}", str(tmp_path)) in err, err
    assert not (tmp_path / "tok").exists()  # nothing written on bad input
