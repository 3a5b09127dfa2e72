"""The user's data without the actor system: formats, masks, the order contract, the cache, bad input."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatrain.data import IGNORE, DataConfig, open_data
from megatrain.data import cache as cache_mod
from megatrain.errors import DataError
from tests.data_fixtures import (
    MODEL_VOCAB,
    SILENT_TEMPLATE,
    chat_records,
    make_tokenizer,
    prompt_completion_records,
    text_records,
    write_jsonl,
)
from tests.data_fixtures import data_config as cfg
from tests.harness import started_since

HF = SimpleNamespace(vocab_size=MODEL_VOCAB, pad_token_id=None)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)


def small_ranges(monkeypatch, size: int) -> None:
    """Byte ranges of `size` bytes, and the process pool even for a small file."""
    for name in ("CHUNK_BYTES", "MIN_CHUNK_BYTES"):
        monkeypatch.setattr(cache_mod, name, size)
    monkeypatch.setattr(cache_mod, "POOL_MIN_BYTES", 0)


def stream_of(tokenizer, records: list[dict]) -> list[int]:
    """Hand-built packed stream: each document's tokens, then EOS."""
    out: list[int] = []
    for r in records:
        out += tokenizer(r["text"])["input_ids"] + [tokenizer.eos_token_id]
    return out


# ---- text: packing and the order contract ----------------------------------------------------------
def test_text_windows_follow_the_documented_order(tmp_path, tok_dir, tokenizer) -> None:
    recs_a, recs_b = text_records(30, seed=1), text_records(20, seed=9)
    a, b = write_jsonl(tmp_path / "a.jsonl", recs_a), write_jsonl(tmp_path / "b.jsonl", recs_b)
    data = open_data(cfg(tmp_path, tok_dir, kind="text", path=[str(a), str(b)]), HF, None)
    stream = stream_of(tokenizer, recs_a + recs_b)
    L, B = 16, 2
    assert len(data.train) == len(stream) // L
    for t in range(data.order.per_epoch):
        got = data.batch(t)
        want = torch.tensor([stream[w * L : (w + 1) * L] for w in range(t * B, (t + 1) * B)])
        assert torch.equal(got.ids, want) and torch.equal(got.labels, want), t  # every token labelled
    # The next epoch starts over, in the same (unshuffled) order.
    assert torch.equal(data.batch(data.order.per_epoch).ids, data.batch(0).ids)
    assert data.batch(data.order.per_epoch).epoch == pytest.approx(
        (data.order.per_epoch + 1) / data.order.per_epoch, abs=1e-4
    )


def test_a_glob_takes_files_in_sorted_order(tmp_path, tok_dir, tokenizer) -> None:
    recs = [text_records(10, seed=s) for s in (4, 5, 6)]
    for i, r in enumerate(recs):
        write_jsonl(tmp_path / f"part-{2 - i}.jsonl", r)  # part-2 holds recs[0]
    data = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(tmp_path / "part-*.jsonl")), HF, None)
    stream = stream_of(tokenizer, recs[2] + recs[1] + recs[0])
    assert data.batch(0).ids[0].tolist() == stream[:16]


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(60))
    c = cfg(tmp_path, tok_dir, kind="text", path=str(path), shuffle=True, seed=3)
    data, again = open_data(c, HF, None), open_data(c, HF, None)
    per = data.order.per_epoch
    windows = {tuple(data.train.item(w)[0]) for w in range(len(data.train))}
    for epoch in range(2):
        seen = [tuple(r) for t in range(epoch * per, (epoch + 1) * per) for r in data.batch(t).ids.tolist()]
        assert len(set(seen)) == len(seen) == per * 2 and set(seen) <= windows  # each window at most once
    for t in (0, 5, per + 1):  # a pure function of (files, seed, t)
        assert torch.equal(data.batch(t).ids, again.batch(t).ids)
    assert not torch.equal(data.batch(0).ids, data.batch(per).ids)  # epochs differ
    other = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), shuffle=True, seed=4), HF, None)
    assert not torch.equal(other.batch(0).ids, data.batch(0).ids)


def test_epochs_set_the_step_count(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(40))
    data = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), epochs=3), HF, None)
    assert data.steps(1000) == 3 * data.order.per_epoch
    assert open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), HF, None).steps(7) == 7


def test_eval_fraction_holds_out_the_last_windows(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(60))
    full = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), HF, None)
    data = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), eval_fraction=0.25), HF, None)
    n = len(full.train)
    held = round(n * 0.25)
    assert len(data.train) == n - held and len(data.eval) == held
    batches = data.eval_batches(0)
    assert sum(b[0].shape[0] for b in batches) == held  # the last batch may be smaller
    assert torch.equal(batches[0][0][0], torch.from_numpy(full.train.item(n - held)[0]))
    assert len(data.eval_batches(1)) == 1


# ---- chat and prompt/completion: masks -------------------------------------------------------------
def test_chat_masks_every_assistant_turn_and_nothing_else(tmp_path, tok_dir, tokenizer) -> None:
    convo = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on a mat"},
            {"role": "user", "content": "the dog"},
            {"role": "assistant", "content": "ran"},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [convo] * 2)
    data = open_data(cfg(tmp_path, tok_dir, kind="chat", path=str(path), seq_len=64), HF, None)
    ids, labels = data.batch(0).ids[0].tolist(), data.batch(0).labels[0].tolist()
    # By hand: the special markers split the text, so each piece tokenizes on its own.
    sp = tokenizer.convert_tokens_to_ids
    pieces = [
        ("<|system|>", 0),
        ("be brief", 0),
        ("<|end|>", 0),
        ("<|user|>", 0),
        ("the cat", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("sat on a mat", 1),
        ("<|end|>", 1),
        ("<|user|>", 0),
        ("the dog", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("ran", 1),
        ("<|end|>", 1),
    ]
    want_ids, want_mask = [], []
    for text, m in pieces:
        toks = [sp(text)] if text.startswith("<|") else tokenizer(text, add_special_tokens=False)["input_ids"]
        want_ids += toks
        want_mask += [m] * len(toks)
    n = len(want_ids)
    assert ids[:n] == want_ids
    assert labels[:n] == [i if m else IGNORE for i, m in zip(want_ids, want_mask)]
    assert ids[n:] == [tokenizer.pad_token_id] * (64 - n) and labels[n:] == [IGNORE] * (64 - n)


# Earlier assistant turns rendered differently from a last one (as templates that strip earlier
# reasoning do): the prefix rule cannot apply to them.
REWRITING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|assistant|><|system|>' + m['content'] + '<|end|>' }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def test_chat_masks_when_the_template_renders_earlier_turns_differently(tmp_path, tokenizer) -> None:
    """An echoing assistant ('the cat' after 'the cat'): the label goes on the assistant's copy, with its
    end-of-turn marker, and never on the user's identical text."""
    tok = make_tokenizer(tmp_path / "tok", REWRITING_TEMPLATE)
    convo = {
        "messages": [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "the cat"},
            {"role": "user", "content": "a dog"},
            {"role": "assistant", "content": "big dog"},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [convo] * 2)
    data = open_data(cfg(tmp_path, tok, kind="chat", path=str(path), seq_len=64), HF, None)
    ids, labels = data.batch(0).ids[0].tolist(), data.batch(0).labels[0].tolist()
    sp = tokenizer.convert_tokens_to_ids
    pieces = [
        ("<|user|>", 0),
        ("the cat", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("<|system|>", 0),
        ("the cat", 1),
        ("<|end|>", 1),
        ("<|user|>", 0),
        ("a dog", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("big dog", 1),
        ("<|end|>", 1),
    ]
    want_ids, want_labels = [], []
    for text, m in pieces:
        toks = [sp(text)] if text.startswith("<|") else tokenizer(text, add_special_tokens=False)["input_ids"]
        want_ids += toks
        want_labels += toks if m else [IGNORE] * len(toks)
    assert ids[: len(want_ids)] == want_ids and labels[: len(want_ids)] == want_labels


def test_a_byte_order_mark_is_accepted(tmp_path, tok_dir) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in text_records(30)).encode())
    plain = write_jsonl(tmp_path / "plain.jsonl", text_records(30))
    a = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), HF, None)
    b = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(plain)), HF, None)
    assert torch.equal(a.batch(0).ids, b.batch(0).ids)


def test_prompt_completion_labels_the_completion_and_eos(tmp_path, tok_dir, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat ?", "completion": " sat on a mat"}] * 2)
    data = open_data(cfg(tmp_path, tok_dir, kind="prompt_completion", path=str(path), seq_len=32), HF, None)
    ids, labels = data.batch(0).ids[0].tolist(), data.batch(0).labels[0].tolist()
    p = tokenizer("the cat ?")["input_ids"]
    c = tokenizer(" sat on a mat", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[: len(p) + len(c)] == p + c
    assert labels[: len(p) + len(c)] == [IGNORE] * len(p) + c
    assert set(labels[len(p) + len(c) :]) == {IGNORE}


def test_padded_examples_are_cut_and_the_cut_is_reported(tmp_path, tok_dir, capsys) -> None:
    long = {"prompt": "the cat " * 40, "completion": " ran"}  # the completion falls beyond seq_len
    recs = [long] + prompt_completion_records(5)
    path = write_jsonl(tmp_path / "p.jsonl", recs)
    data = open_data(cfg(tmp_path, tok_dir, kind="prompt_completion", path=str(path), seq_len=64), HF, None)
    first = data.batch(0)
    assert first.ids.shape == (2, 64) and bool((first.labels[0] == IGNORE).all())
    out = capsys.readouterr().out
    assert "1 of 6 examples are longer than seq_len 64" in out and "1 of them kept no label token" in out


def test_packed_chat_keeps_the_masks_in_the_stream(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    packed = open_data(cfg(tmp_path, tok_dir, kind="chat", path=str(path), packing=True), HF, None)
    padded = open_data(cfg(tmp_path, tok_dir, kind="chat", path=str(path), seq_len=128), HF, None)
    stream, labels = [], []
    for i in range(len(padded.train)):
        ids, lab = padded.train.item(i)
        keep = ids != padded.train.pad_id
        stream += ids[keep].tolist()
        labels += lab[keep].tolist()
    b = packed.batch(1)
    assert b.ids[0].tolist() == stream[32:48] and b.labels[0].tolist() == labels[32:48]


# ---- token files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_token_files_are_windows_of_the_file(tmp_path, dtype: str) -> None:
    tokens = (np.arange(1000) * 7 % MODEL_VOCAB).astype(dtype)
    np.save(tmp_path / "a.npy", tokens[:600])
    tokens[600:].tofile(tmp_path / "b.bin")
    c = DataConfig(
        kind="tokens",
        path=[str(tmp_path / "a.npy"), str(tmp_path / "b.bin")],
        token_dtype=dtype,
        seq_len=10,
        batch_size=3,
        shuffle=False,
    )
    data = open_data(c, HF, None)
    assert len(data.train) == 100
    got = data.batch(20)  # windows 60..62: across the file boundary at token 600
    assert got.ids.tolist() == tokens[600:630].astype(np.int64).reshape(3, 10).tolist()
    assert torch.equal(got.ids, got.labels)


# ---- the cache -------------------------------------------------------------------------------------
def test_cache_is_reused_and_keyed_by_contents(tmp_path, tok_dir, capsys) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(30))
    c = cfg(tmp_path, tok_dir, kind="text", path=str(path))
    first = open_data(c, HF, None)
    assert "tokenized" in capsys.readouterr().out
    again = open_data(c, HF, None)
    assert "tokenized" not in capsys.readouterr().out and torch.equal(first.batch(0).ids, again.batch(0).ids)
    write_jsonl(path, text_records(30, seed=42))
    changed = open_data(c, HF, None)
    assert "tokenized" in capsys.readouterr().out and not torch.equal(changed.batch(0).ids, first.batch(0).ids)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2  # no temporary directory left


def test_parallel_build_equals_the_single_process_one(tmp_path, tok_dir, monkeypatch) -> None:
    small_ranges(monkeypatch, 2048)  # many ranges, two processes
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(120))
    one = open_data(cfg(tmp_path / "one", tok_dir, kind="chat", path=str(path), seq_len=64), HF, None)
    two = open_data(cfg(tmp_path / "two", tok_dir, kind="chat", path=str(path), seq_len=64, num_workers=2), HF, None)
    for a, b in zip(one.train.files, two.train.files):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)
        assert np.array_equal(a.offsets, b.offsets)
    assert len(one.train) == 120


# ---- bad input: one line naming the file and line --------------------------------------------------
def _lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"text": "the cat sat"})
CHAT_OK = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})


@pytest.mark.parametrize(
    "kind, lines, where, words",
    [
        ("text", [GOOD, "{not json"], ":2:", "not valid JSON"),
        ("text", [GOOD, GOOD, "[1, 2]"], ":3:", "expected a JSON object"),
        ("text", [GOOD, json.dumps({"body": "x"})], ":2:", "missing field 'text'"),
        ("text", [GOOD, json.dumps({"text": 3})], ":2:", "must be a string"),
        ("chat", [CHAT_OK, json.dumps({"messages": [{"role": "user", "content": "a"}]})], ":2:", "no assistant turn"),
        (
            "chat",
            [json.dumps({"messages": [{"role": "wizard", "content": "a"}, {"role": "assistant", "content": "b"}]})],
            ":1:",
            "unknown role wizard",
        ),
        ("chat", [CHAT_OK, json.dumps({"messages": "hi"})], ":2:", "messages"),
        ("prompt_completion", [json.dumps({"prompt": "a"})], ":1:", "missing field 'completion'"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, tok_dir, kind: str, lines: list[str], where: str, words: str) -> None:
    path = _lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as exc:
        open_data(cfg(tmp_path, tok_dir, kind=kind, path=str(path)), HF, None)
    assert f"{path}{where}" in str(exc.value) and words in str(exc.value)


def test_not_utf8_names_the_line(tmp_path, tok_dir) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid UTF-8"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), HF, None)


def test_a_bad_line_in_a_later_range_of_a_parallel_build_names_its_line(tmp_path, tok_dir, monkeypatch) -> None:
    small_ranges(monkeypatch, 1024)
    lines = [GOOD] * 400
    lines[345] = "oops"
    path = _lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=r"bad.jsonl:346: not valid JSON"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), num_workers=2), HF, None)


def test_a_role_the_template_drops_is_refused(tmp_path) -> None:
    tok = make_tokenizer(tmp_path / "tok", SILENT_TEMPLATE)
    convo = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [json.loads(CHAT_OK), convo])
    with pytest.raises(DataError, match=r"c.jsonl:2: message 0 \(role 'system'\).*does not know this role"):
        open_data(cfg(tmp_path, tok, kind="chat", path=str(path)), HF, None)


@pytest.mark.parametrize(
    "setup, words",
    [
        ("missing", "does not exist"),
        ("directory", "is a directory, neither a JSONL file nor"),
        ("empty", "no records (the file is empty)"),
        ("blank-lines", "no records (the file is empty)"),
        ("no-match", "no file matches"),
        ("too-few", "one batch needs data.batch_size 2"),
    ],
)
def test_unusable_files_are_refused(tmp_path, tok_dir, setup: str, words: str) -> None:
    path = tmp_path / "d.jsonl"
    if setup == "empty":
        path.write_text("")
    elif setup == "blank-lines":
        path.write_text("\n\n  \n")
    elif setup == "too-few":
        path.write_text(GOOD + "\n")
    elif setup == "no-match":
        path = tmp_path / "nothing-*.jsonl"
    elif setup == "directory":
        path = tmp_path / "somedir"
        path.mkdir()
    with pytest.raises(DataError, match=re.escape(words)):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), HF, None)


def test_evaluation_data_must_hold_a_window_and_an_empty_override_is_none(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(40))
    tiny = write_jsonl(tmp_path / "e.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="data.eval_path: the evaluation data holds no window"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), eval_path=str(tiny)), HF, None)
    data = open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), eval_path=""), HF, None)
    assert data.eval is None and not data.has_eval


def test_token_file_problems_are_refused(tmp_path) -> None:
    def load(arr: np.ndarray, name: str = "t.npy", **kw):
        np.save(tmp_path / name, arr)
        return open_data(DataConfig(kind="tokens", path=str(tmp_path / name), seq_len=4, batch_size=2, **kw), HF, None)

    with pytest.raises(DataError, match=rf"token id {MODEL_VOCAB} at index 5 is outside"):
        load(np.array([1, 2, 3, 4, 5, MODEL_VOCAB, 1, 1, 1], np.uint16))
    with pytest.raises(DataError, match="token id -1 at index 0"):
        load(np.array([-1] * 9, np.int32))
    with pytest.raises(DataError, match="tokens of type float32"):
        load(np.zeros(9, np.float32))
    with pytest.raises(DataError, match="holds 1 windows"):
        load(np.ones(7, np.uint16))
    with pytest.raises(DataError, match="no tokens"):
        load(np.zeros(0, np.uint16))


def test_tokenizer_problems_are_refused(tmp_path, tok_dir) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", text_records(10))
    with pytest.raises(DataError, match=r"data.tokenizer: tokenizer directory '.*nowhere' does not exist"):
        open_data(cfg(tmp_path, tmp_path / "nowhere", kind="text", path=str(path)), HF, None)
    with pytest.raises(DataError, match="has 300 tokens, more than the model's vocab_size 256"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path)), SimpleNamespace(vocab_size=256), None)
    with pytest.raises(DataError, match="needs a tokenizer"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(path), tokenizer=None), HF, None)


# ---- datasets.save_to_disk directories (the optional `datasets` extra) -----------------------------
@pytest.mark.parametrize(
    "kind, records",
    [("text", text_records(40)), ("chat", chat_records(30)), ("prompt_completion", prompt_completion_records(20))],
)
def test_save_to_disk_directory_equals_the_same_jsonl(tmp_path, tok_dir, monkeypatch, kind: str, records: list) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(cache_mod, "DATASET_ROWS", 7)  # several parts
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    a = open_data(cfg(tmp_path, tok_dir, kind=kind, path=str(tmp_path / "ds"), seq_len=64), HF, None)
    b = open_data(cfg(tmp_path, tok_dir, kind=kind, path=str(jsonl), seq_len=64), HF, None)
    for t in range(3):
        assert torch.equal(a.batch(t).ids, b.batch(t).ids) and torch.equal(a.batch(t).labels, b.batch(t).labels)


def test_save_to_disk_problems_are_refused(tmp_path, tok_dir) -> None:
    datasets = pytest.importorskip("datasets")
    recs = text_records(10)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="several splits \\(train\\)"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(tmp_path / "dd")), HF, None)
    datasets.Dataset.from_list([{"body": "x"}] * 3).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="bad: row 0: missing field 'text'"):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(tmp_path / "bad")), HF, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DataError,
        match="data.path: '.*empty' is a directory, neither a JSONL file nor a directory "
        "written by datasets.save_to_disk",
    ):
        open_data(cfg(tmp_path, tok_dir, kind="text", path=str(tmp_path / "empty")), HF, None)


def test_no_tokenizer_process_outlives_the_build(tmp_path, tok_dir, monkeypatch) -> None:
    psutil = pytest.importorskip("psutil")
    small_ranges(monkeypatch, 2048)
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(60))
    from multiprocessing import resource_tracker

    # multiprocessing's tracker, started by the first spawned process, lives as long as this process: not a
    # tokenizer (run alone, this test would otherwise find it; in the suite an earlier test has started it)
    resource_tracker.ensure_running()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    open_data(cfg(tmp_path, tok_dir, kind="chat", path=str(path), seq_len=64, num_workers=2), HF, None)
    deadline = time.monotonic() + 60  # a bound on the wait for their exit, not a measure of it
    while started_since(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not started_since(before)
