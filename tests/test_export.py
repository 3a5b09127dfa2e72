"""`megatrain-launch export`: a checkpoint as an HF directory that from_pretrained loads, streamed into
shards; the weights are the checkpoint's exactly (fp32) or rounded once (bf16), and the loaded model's
loss equals the engine's with the same weights."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain.data import DataConfig, batch
from megatrain.data.arithmetic import END_ID
from megatrain.formats import checkpoint as ckpt
from megatrain.formats.export import RECORD
from megatrain.launch.cli import main as cli
from megatrain.step.engine import EngineConfig, StepEngine
from tests.harness import train_tiny as run
from tests.model_fixtures import DictSource, spec_for


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    m = ckpt.manifest_of(step_dir)
    params = np.fromfile(step_dir / "host-0" / "params.bin", dtype=np.float32)
    out = {}
    for u in m["units"]:
        for name, (shape, off) in u["tensors"].items():
            lo = u["offset"] + off
            out[name] = torch.from_numpy(params[lo : lo + int(np.prod(shape))].reshape(shape).copy())
    return out


@pytest.mark.parametrize(
    "family, dtype, shard_gb",
    [
        ("llama", "fp32", 5.0),
        ("qwen2", "bf16", 0.00005),
        ("mistral", "fp32", 0.00005),
        ("qwen3", "bf16", 0.00005),
        ("mixtral", "fp32", 0.00005),  # experts written per expert (w1/w3/w2), as HF writes them
        ("qwen2_moe", "bf16", 5.0),
        ("qwen3_moe", "fp32", 5.0),
        ("olmoe", "fp32", 0.00005),
        ("gpt_oss", "fp32", 0.00005),
    ],
)
def test_export_loads_with_from_pretrained_and_matches(
    tmp_path: Path, family: str, dtype: str, shard_gb: float, capsys
) -> None:
    run(tmp_path / "run", family, steps=5)  # qwen2 ties its embeddings in this helper
    step = ckpt.step_dir(tmp_path / "run" / "checkpoints", 5)
    out = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "run"), str(out), "--dtype", dtype, "--shard-gb", str(shard_gb)]) == 0
    assert f"export: wrote {out}: step 5, from {step.resolve()}" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and all(stat.S_IMODE((out / f).stat().st_mode) == 0o644 for f in files)
    sharded = shard_gb < 1
    assert ("model.safetensors.index.json" in files) == sharded
    assert sum(f.endswith(".safetensors") for f in files) > (1 if sharded else 0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = checkpoint_tensors(step)
    got = model.state_dict()
    for name, t in want.items():
        expect = t if dtype == "fp32" else t.to(torch.bfloat16).float()
        assert torch.equal(got[name], expect), name
    # The engine, fed the checkpoint's fp32 weights, and the exported model agree on the loss.
    ids, labels = batch(DataConfig(seq_len=32, batch_size=2), 0)
    spec = spec_for(model, family)
    engine = StepEngine(spec, EngineConfig(), torch.device("cpu"), torch.float32)
    loss_sum, tokens = engine.evaluate(ids, labels, DictSource(spec, want))
    with torch.no_grad():
        hf_out = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids, labels=labels)
    ref = hf_out.loss  # the language-model loss: HF adds coef·aux with output_router_logits (MoE)
    if getattr(hf_out, "aux_loss", None) is not None:
        ref = ref - model.config.router_aux_loss_coef * hf_out.aux_loss
    ours = float(loss_sum) / int(tokens)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    assert abs(ours - float(ref)) <= tol * abs(float(ref)), (ours, float(ref))


def test_save_final_is_the_same_export(tmp_path: Path) -> None:
    summary = run(tmp_path / "run", "llama", "train.save_final=true", steps=5)
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["use_cache"] is True
    record = json.loads((final / RECORD).read_text())
    assert record == {"step": 5, "checkpoint": None, "run_id": summary.run_id, "dtype": "fp32"}
    assert stat.S_IMODE((final / "model.safetensors").stat().st_mode) == 0o644
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    want = checkpoint_tensors(ckpt.step_dir(tmp_path / "run" / "checkpoints", 5))
    assert all(torch.equal(model.state_dict()[n], t) for n, t in want.items())


def test_export_of_a_directory_without_checkpoints_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert cli.main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"export: error: SOURCE: '{tmp_path}' is neither a complete checkpoint" in err, err
    assert "train.resume" not in err and len(err.strip().splitlines()) == 1, err  # export's own terms


def test_export_refuses_in_one_line_what_it_cannot_do(tmp_path: Path, capsys) -> None:
    """Onto an existing file or a directory that holds files, and from a checkpoint whose weights are corrupt:
    exit 2, one line in export's terms, nothing written."""
    run(tmp_path / "run", "llama", steps=5)
    src = str(tmp_path / "run")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    capsys.readouterr()
    for out, words in ((tmp_path / "file", "exists and is not a directory"), (tmp_path / "full", "is not empty")):
        assert cli.main(["export", src, str(out)]) == 2
        err = capsys.readouterr().err
        assert f"export: error: OUT '{out}' {words}" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "file").read_text() == "x" and [p.name for p in (tmp_path / "full").iterdir()] == ["config.json"]
    params = ckpt.step_dir(tmp_path / "run" / "checkpoints", 5) / "host-0" / "params.bin"
    data = bytearray(params.read_bytes())
    data[-5000] ^= 0x01
    params.write_bytes(bytes(data))
    assert cli.main(["export", src, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"export: error: {params} is corrupt: bytes " in err and "from tensor 'lm_head.weight'" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists(), err


def test_import_of_sharded_bf16_weights_and_a_truncated_shard(tmp_path: Path, capsys) -> None:
    """model.pretrained: a sharded bf16 save_pretrained directory is read unit by unit into the fp32 store
    (exactly the bf16 values), and a truncated shard is a usage error naming the file."""
    from tests.model_fixtures import tiny_hf

    src = tmp_path / "src"
    model = tiny_hf("llama", tied=False, layers=3).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").is_file()
    run(tmp_path / "run", "llama", f"model.pretrained={src}", "model.hf={}", "train.save_final=true", steps=0)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t.float()), name
    shard = sorted(src.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    capsys.readouterr()
    args = [
        str(Path(__file__).parents[1] / "examples/default.yaml"),
        f"model.pretrained={src}",
        "model.hf={}",
        f"train.output_dir={tmp_path / 'run2'}",
        "launch.runner=inprocess",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "truncated" in err


def test_export_of_a_run_that_saved_no_checkpoint_says_which_settings_write_one(tmp_path: Path, capsys) -> None:
    """A run without train.save_every keeps no checkpoint: export's error says so and names the settings that
    write one; where the run wrote final/ (train.save_final), it points there instead."""
    run(tmp_path / "run", "llama", "train.save_every=0", steps=2)
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "run" / "checkpoints").exists()
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is a run's output directory with no checkpoint" in err, err
    assert "train.save_every=N" in err and "train.save_final=true" in err and len(err.strip().splitlines()) == 1
    run(tmp_path / "final", "llama", "train.save_every=0", "train.save_final=true", steps=2)
    assert cli.main(["export", str(tmp_path / "final"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"its {tmp_path / 'final' / 'final'} is already an HF directory" in err, err


def test_export_takes_the_special_ids_from_the_tokenizer_and_generates_with_the_cache(tmp_path: Path, capsys) -> None:
    """A fresh model keeps its class's defaults (bos 1, eos 2); the user's tokenizer ends texts with id 0.
    The exported config and generation config carry the tokenizer's ids, with the KV cache on, so
    generate() stops at the tokenizer's end token."""
    from transformers import AutoTokenizer, GenerationConfig

    from megatrain.formats.export import export
    from megatrain.model.weights import flat_unit
    from tests.data_fixtures import MODEL_VOCAB, make_tokenizer
    from tests.model_fixtures import tiny_hf

    tok_dir = make_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)  # '<|endoftext|>' and '<|pad|>', ids the defaults miss
    model = tiny_hf("llama", tied=False)
    model.config.vocab_size = MODEL_VOCAB
    model.resize_token_embeddings(MODEL_VOCAB)
    spec = spec_for(model, "llama")
    state = model.state_dict()
    assert (spec.hf_config.bos_token_id, spec.hf_config.eos_token_id) == (1, 2)
    out = export(spec, lambda u: flat_unit(spec, u, state), tmp_path / "hf", tokenizer=tok_dir)
    config = json.loads((out / "config.json").read_text())
    assert tok.bos_token_id is None  # and the model's default bos 1 names a merge, not a start token: dropped
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"], config["use_cache"]) == (
        None,
        0,
        1,
        True,
    )
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id, gen.use_cache) == (None, 0, 1, True)
    said = capsys.readouterr().out
    assert "config eos_token_id 2 -> 0 (the tokenizer's '<|endoftext|>')" in said
    assert "config bos_token_id 1 -> None (the tokenizer has no bos token)" in said
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ids = loaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert ids.shape[1] <= 7  # it ran, with the cache, under the exported generation config


def test_export_of_byte_data_carries_the_ids_the_data_uses_and_its_step(tmp_path: Path, capsys) -> None:
    """The bundled arithmetic data is bytes with no tokenizer: a newline ends every answer, and there is
    no start or padding token. The exported config says so instead of Llama's defaults (bos 1, eos 2,
    bytes the data never holds), and generate() stops after an answer's newline. The directory and the
    command's line name the checkpoint step exported: the older one when it is named."""
    from transformers import GenerationConfig

    summary = run(tmp_path / "run", "llama", steps=10)
    older = ckpt.step_dir(tmp_path / "run" / "checkpoints", 5)
    for src, step, out in ((tmp_path / "run", 10, tmp_path / "hf"), (older, 5, tmp_path / "hf5")):
        capsys.readouterr()
        assert cli.main(["export", str(src), str(out)]) == 0
        said = capsys.readouterr().out
        assert f"wrote {out}: step {step}, from {ckpt.step_dir(tmp_path / 'run' / 'checkpoints', step)}" in said
        record = json.loads((out / RECORD).read_text())
        assert (record["step"], record["run_id"], record["dtype"]) == (step, summary.run_id, "fp32")
        config = json.loads((out / "config.json").read_text())
        ids = (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
        assert ids == (None, END_ID, None), ids
        gen = GenerationConfig.from_pretrained(out)
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (None, END_ID, None)
        assert "config eos_token_id 2 -> 10 (byte data: a newline ends every answer)" in said
    # An id the user set in model.hf is theirs to keep.
    run(tmp_path / "run2", "llama", "model.hf.eos_token_id=61", steps=5)
    assert cli.main(["export", str(tmp_path / "run2"), str(tmp_path / "hf2")]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["eos_token_id"] == 61


def test_special_ids_of_token_data_are_the_ones_the_run_states(tmp_path: Path) -> None:
    """A token file has no tokenizer: only the ids the config states (model.hf, else model.pretrained's
    config.json) are written, the others are None; a tokenizer beside the data wins over both."""
    from transformers import LlamaConfig

    from megatrain.errors import ConfigError
    from megatrain.model.specialids import apply_ids, run_tokenizer, special_ids
    from tests.data_fixtures import make_tokenizer

    hf = LlamaConfig()  # bos 1, eos 2: the class's defaults
    plain = {"data": {"kind": "tokens"}, "model": {"hf": {"eos_token_id": 7}}}
    assert run_tokenizer(plain) is None
    assert {k: v for k, (v, _) in special_ids(plain, hf, None).items()} == {
        "bos_token_id": None,
        "eos_token_id": 7,
        "pad_token_id": None,
    }
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 5, "eos_token_id": [6, 8]}))
    on_pretrained = {"data": {"kind": "tokens"}, "model": {"pretrained": str(pre), "hf": {}}}
    assert run_tokenizer(on_pretrained) is None  # its directory holds no tokenizer
    assert {k: v for k, (v, _) in special_ids(on_pretrained, hf, None).items()} == {
        "bos_token_id": 5,
        "eos_token_id": [6, 8],
        "pad_token_id": None,
    }
    tok = make_tokenizer(tmp_path / "tok")
    with_tok = {"data": {"kind": "tokens", "tokenizer": str(tok)}, "model": {"hf": {"eos_token_id": 7}}}
    assert run_tokenizer(with_tok) == str(tok)
    ids = special_ids(with_tok, hf, run_tokenizer(with_tok))
    assert {k: v for k, (v, _) in ids.items()} == {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1}
    bytes_run = {"data": {"kind": "arithmetic", "tokenizer": str(tok)}, "model": {"hf": {}}}
    assert run_tokenizer(bytes_run) is None  # byte tokens, whatever data.tokenizer says
    small = LlamaConfig(vocab_size=300)
    with pytest.raises(ConfigError, match="eos_token_id 300 \\(model.hf\\) is outside the model's vocabulary of 300"):
        apply_ids(small, special_ids({"data": {"kind": "tokens"}, "model": {"hf": {"eos_token_id": 300}}}, small, None))
