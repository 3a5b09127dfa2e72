"""Packed documents (data.pack_documents): positions and labels from the data path, the engine against the
HF model run one document at a time (fp32, 1e-5), and a run through the in-process runner that matches
plain PyTorch given the same positions; the configurations that cannot have it are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatrain.data import IGNORE, DataConfig, open_data
from megatrain.data.cache import TokenFile
from megatrain.data.datasets import Packed
from megatrain.errors import ConfigError, DataError
from megatrain.ipc.protocol import blocks
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.config.tree import load_config
from megatrain.layers.documents import documents_of
from megatrain.model.weights import flat_unit
from megatrain.step.engine import EngineConfig, StepEngine
from tests.data_fixtures import MODEL_VOCAB, chat_records, make_tokenizer, text_records, write_jsonl
from tests.data_fixtures import data_config as data_cfg
from tests.data_fixtures import data_overrides as overrides
from tests.harness import check_match
from tests.model_fixtures import DictSink, DictSource, hf_one_by_one, packed_batch, spec_for, tiny_hf, windowed_hf

I = IGNORE  # noqa: E741 - short, for the tables below


# ---- positions and labels --------------------------------------------------------------------------
def _packed(parts: list[list[int]], seq_len: int, eos: list[int]) -> Packed:
    """Token files (no records) holding `parts`, in windows of `seq_len` with documents on."""
    files = [TokenFile(f"{i}.npy", np.array(p, np.uint16), None, None) for i, p in enumerate(parts)]
    return Packed(files, seq_len, True, eos)


def test_positions_restart_after_eos_and_labels_stop_at_boundaries() -> None:
    """EOS 0 ends a document and belongs to it. A window ending in EOS, consecutive EOS (an empty
    document) across a window boundary, and a window across a file boundary (a new file starts a
    document)."""
    src = _packed([[5, 6, 7, 0, 8, 9, 0, 0, 0, 10, 11, 0, 12, 13], [14, 15]], 4, [0])
    want = [
        ([5, 6, 7, 0], [0, 1, 2, 3], [5, 6, 7, 0]),  # ends with EOS
        ([8, 9, 0, 0], [0, 1, 2, 0], [8, 9, 0, I]),  # the EOS after an EOS is a document of its own
        ([0, 10, 11, 0], [0, 0, 1, 2], [0, I, 11, 0]),  # and another one, first in its window
        ([12, 13, 14, 15], [0, 1, 0, 1], [12, 13, I, 15]),  # mid-file start; the second file is a new document
    ]
    assert len(src) == len(want)
    for w, (ids, pos, labels) in enumerate(want):
        got = src.item(w)
        assert [x.tolist() for x in got] == [ids, labels, pos], w


def test_a_window_starting_mid_document_starts_at_zero() -> None:
    src = _packed([[1, 2, 3, 4, 5, 6, 0, 7, 8, 9]], 5, [0])
    ids, labels, pos = src.item(1)  # [6, 0, 7, 8, 9]: the document of 1..6 began in window 0
    assert pos.tolist() == [0, 1, 0, 1, 2] and labels.tolist() == [6, 0, I, 8, 9]


def test_several_eos_ids_and_the_batch_tensors(tmp_path) -> None:
    """A model whose config lists several EOS ids (Llama 3 style): each ends a document; Data.batch and
    Data.eval_batch carry the positions, and the engine's document lengths follow them."""
    np.save(tmp_path / "t.npy", np.array([3, 4, 1, 5, 2, 6, 7, 8] * 4, np.uint16))
    hf = SimpleNamespace(vocab_size=16, pad_token_id=None, eos_token_id=[1, 2])
    cfg = DataConfig(
        kind="tokens", path=str(tmp_path / "t.npy"), seq_len=8, batch_size=2, shuffle=False, pack_documents=True
    )
    data = open_data(cfg, hf, None)
    b = data.batch(0)
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] * 2
    assert b.labels.tolist() == [[3, 4, 1, I, 2, I, 7, 8]] * 2
    assert documents_of(b.ids, b.positions) == [[3, 2, 3]] * 2
    assert len(open_data(dataclasses.replace(cfg, eval_fraction=0.5), hf, None).eval_batch(0)) == 3


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_jsonl_documents_are_the_records(tmp_path, tok_dir, kind: str) -> None:
    """For the JSONL kinds a document is a record (the cache's record boundaries): chat renders no EOS at
    the end of a conversation, and the positions restart at each record all the same."""
    recs = text_records(40) if kind == "text" else chat_records(30)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    cfg = data_cfg(
        tmp_path, tok_dir, kind=kind, path=str(path), seq_len=32, packing=kind == "chat", pack_documents=True
    )
    hf = SimpleNamespace(vocab_size=MODEL_VOCAB, pad_token_id=None)
    data = open_data(cfg, hf, None)
    plain = open_data(dataclasses.replace(cfg, pack_documents=False), hf, None)
    tf = data.train.files[0]
    starts = np.zeros(tf.ids.size, bool)
    starts[np.asarray(tf.offsets[:-1])] = True
    for w in range(len(data.train)):
        ids, labels, pos = data.train.item(w)
        s = starts[w * 32 : (w + 1) * 32].copy()
        s[0] = True
        assert np.array_equal(pos == 0, s), w
        assert np.all(np.diff(pos)[~s[1:]] == 1), w
        _, plain_labels = plain.train.item(w)
        assert np.array_equal(labels, np.where(s & (np.arange(32) > 0), I, plain_labels)), w


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tile, chunk, lean", [(0, 0, 0), (7, 1, 0), (0, 1, 1)])
def test_packed_documents_are_the_documents_run_one_by_one(family: str, tile: int, chunk: int, lean: int) -> None:
    """Loss and every unit's gradient of a packed step are the HF model's on each document alone (Qwen2:
    full attention in layer 0, a window of 6 above, shorter than some documents); with token tiles
    that do not divide the tokens, two sequence chunks, and a lean layer. The same batch without
    positions is another computation: the test can fail."""
    model = tiny_hf("llama", tied=False) if family == "llama" else windowed_hf("qwen2", 6, max_window_layers=1)
    spec = spec_for(model, family)
    ids, labels, pos = packed_batch()
    ref, ref_grads = hf_one_by_one(model, ids, labels)

    state = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(
        checkpoint_interval=2,
        last_block_layers=1,
        loss_chunk_tokens=10,
        token_tile=tile,
        chunk_sequences=chunk,
        lean_layers=lean,
    )
    engine = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    sink = DictSink()
    res = engine.step(ids, labels, DictSource(spec, state, blocks=blocks(3, 2, 1)), sink, positions=pos)
    assert abs(float(res.loss) - float(ref)) <= 1e-5 * abs(float(ref))
    assert int(res.tokens) == int((labels[:, 1:] != IGNORE).sum())
    for unit in range(spec.layout.num_layers + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()]
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), unit

    total, tokens = engine.evaluate(ids, labels, DictSource(spec, state), pos)
    assert abs(float(total) / int(tokens) - float(ref)) <= 1e-5 * abs(float(ref))
    # An untrained model's loss is near ln(vocab) either way; the gap is still 20x the tolerance above.
    plain_sink = DictSink()
    plain = engine.step(ids, labels, DictSource(spec, state, blocks=blocks(3, 2, 1)), plain_sink)
    assert abs(float(plain.loss) - float(ref)) > 2e-4 * abs(float(ref))
    want = flat_unit(spec, 1, ref_grads)
    assert torch.linalg.norm(plain_sink.grads[1][: want.numel()] - want) > 1e-2 * torch.linalg.norm(want)


def test_positions_must_fit_the_ids() -> None:
    ids, _, pos = packed_batch()
    with pytest.raises(ValueError, match="positions must be int64 of the ids' shape"):
        documents_of(ids, pos[:, :10])


# ---- a run, and the configurations that cannot have it -----------------------------------------------
def test_a_packed_token_file_run_matches_plain_pytorch(tmp_path, tok_dir) -> None:
    """Token file with the tokenizer's EOS (id 0) ending documents of 3 to 40 tokens: eight steps through
    the in-process runner and an evaluation match the HF model given the same position ids (its own
    packed-sequence masks), and fewer tokens carry a label than without documents."""
    rng = np.random.default_rng(0)
    stream: list[int] = []
    while len(stream) < 2000:  # counting up from a random token: learnable, but not across a boundary
        stream += [*(6 + (rng.integers(0, 200) + np.arange(rng.integers(2, 40))) % 300).tolist(), 0]
    np.save(tmp_path / "t.npy", np.array(stream, np.uint16))
    data = ["data.kind=tokens", f"data.path={tmp_path / 't.npy'}", "data.pack_documents=true"]
    data += ["data.eval_fraction=0.05", "train.eval_every=4"]
    cfg = load_config(None, overrides("llama", tmp_path, tok_dir, data, steps=8))
    rep = compare(cfg, tmp_path)
    check_match(rep)
    rows = rep["summary"].metrics
    assert all(r["tokens"] < 4 * 31 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]  # it learns
    assert rows[-1]["eval_loss"] < rows[3]["eval_loss"]


def test_pack_documents_is_refused_where_nothing_is_packed(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.pack_documents needs packed data.*generated arithmetic"):
        load_config(None, ["data.pack_documents=true"])
    bad = ["data.kind=chat", f"data.path={tmp_path / 'c.jsonl'}", "data.pack_documents=true"]
    with pytest.raises(ConfigError, match="data.pack_documents needs packed data.*padded chat"):
        load_config(None, bad)
    load_config(None, [*bad, "data.packing=true"])  # packed chat has documents


def test_a_token_file_without_a_known_eos_is_refused(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.uint16))
    cfg = DataConfig(kind="tokens", path=str(tmp_path / "t.npy"), seq_len=8, batch_size=2, pack_documents=True)
    with pytest.raises(DataError, match="data.pack_documents: data.kind tokens needs the EOS id"):
        open_data(cfg, SimpleNamespace(vocab_size=64, pad_token_id=None, eos_token_id=None), None)
