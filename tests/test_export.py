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

from megatrain import checkpoint as ckpt
from megatrain.data import DataConfig, batch
from megatrain.engine import EngineConfig, StepEngine
from megatrain.launch import cli
from tests.helpers import DictSource, spec_for
from tests.test_checkpoint import run


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    m = ckpt.manifest_of(step_dir)
    params = np.fromfile(step_dir / "params.bin", dtype=np.float32)
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
    run(tmp_path / "run", "llama", "train.save_final=true", steps=5)
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["use_cache"] is True
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
    params = ckpt.step_dir(tmp_path / "run" / "checkpoints", 5) / "params.bin"
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
    from tests.helpers import tiny_hf

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


def test_export_takes_the_special_ids_from_the_tokenizer_and_generates_with_the_cache(tmp_path: Path, capsys) -> None:
    """A fresh model keeps its class's defaults (bos 1, eos 2); the user's tokenizer ends texts with id 0.
    The exported config and generation config carry the tokenizer's ids, with the KV cache on, so
    generate() stops at the tokenizer's end token."""
    from transformers import AutoTokenizer, GenerationConfig

    from megatrain.export import export
    from tests.data_fixtures import MODEL_VOCAB, make_tokenizer
    from tests.helpers import flat_unit, tiny_hf

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
    assert (config["eos_token_id"], config["pad_token_id"], config["use_cache"]) == (0, 1, True)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.pad_token_id, gen.use_cache) == (0, 1, True)
    assert "config eos_token_id 2 -> 0 (the tokenizer's '<|endoftext|>')" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ids = loaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert ids.shape[1] <= 7  # it ran, with the cache, under the exported generation config
