"""model.pretrained with GPT-OSS's experts in MXFP4, as openai/gpt-oss-20b and -120b publish them: each layer's
`mlp.experts.gate_up_proj` and `down_proj` stored as `<name>_blocks` / `<name>_scales` (uint8), the rest in
bf16, and `quantization_config` in config.json. Read through the real import path (the store owner fills the
store from the directory) into the fp32 masters; a checkpoint that lacks a tensor in every form is refused
naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatrain.errors import ConfigError
from megatrain.formats import mxfp4
from megatrain.launch.cli import main as cli
from megatrain.model.spec import ModelConfig, build_spec, family_classes
from megatrain.model.weights import checkpoint_index, read_unit
from tests.harness import import_args, tiny_config_dict
from tests.harness import train_tiny as run

hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

# The tiny GPT-OSS of the other tests with an expert width of 64: MXFP4 blocks run along each expert
# matrix's input dim, hidden (32) for gate_up_proj and intermediate (64, two blocks) for down_proj.
HF = {**tiny_config_dict("gpt_oss", tied=False, layers=2), "intermediate_size": 64}
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# as in openai/gpt-oss-20b's config.json
QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype == torch.float32
        and torch.equal(a.view(torch.int32), b.view(torch.int32))
    )


def quantized_checkpoint(root: Path, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A tiny GPT-OSS saved as the published checkpoints are: bf16, the experts' matrices in MXFP4 (their
    biases stay bf16). Returns what the fp32 masters should hold: the dequantized experts, the rest as saved."""
    assert HF["hidden_size"] % mxfp4.BLOCK == 0 and HF["intermediate_size"] % mxfp4.BLOCK == 0
    conf_cls, model_cls = family_classes("gpt_oss")
    torch.manual_seed(0)
    model_cls(conf_cls(**HF)).to(torch.bfloat16).save_pretrained(root)
    state = load_file(root / "model.safetensors")
    want = {}
    for name in list(state):
        if name.endswith(EXPERTS):
            blocks, scales = mxfp4.quantize(state.pop(name).float())
            packed = mxfp4.packed_names(name)
            state[packed[0]], state[packed[1]] = blocks, scales
            want[name] = mxfp4.dequantize(blocks, scales)
            # what HF's own MXFP4 loader makes of the pair, bit for bit
            assert _same_bits(want[name], hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        else:
            want[name] = state[name].float()
    for name in drop:
        del state[name]
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return want


def test_mxfp4_experts_import_into_the_fp32_masters(tmp_path: Path) -> None:
    src = tmp_path / "src"
    want = quantized_checkpoint(src)
    with safe_open(src / "model.safetensors", "pt") as f:
        names = set(f.keys())
        # HF's names and shapes: [E, out, in / 32, 16] blocks, [E, out, in / 32] scales, along the input dim
        e, h, i = HF["num_local_experts"], HF["hidden_size"], HF["intermediate_size"]
        layer = "model.layers.1.mlp.experts."
        assert f.get_slice(layer + "gate_up_proj_blocks").get_shape() == [e, 2 * i, h // 32, 16]
        assert f.get_slice(layer + "down_proj_scales").get_shape() == [e, h, i // 32]
        assert f.get_slice(layer + "gate_up_proj_bias").get_dtype() == "BF16"
    assert not names & {n for n in want if n.endswith(EXPERTS)}
    assert all(n + "_blocks" in names and n + "_scales" in names for n in want if n.endswith(EXPERTS))

    # the store filled from the directory by the store owner, written out as it is (fp32) without a step
    run(tmp_path / "run", "gpt_oss", f"model.pretrained={src}", "model.hf={}", "train.save_final=true", steps=0)
    final = tmp_path / "run" / "final"
    with safe_open(final / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(want)
        for name, expect in want.items():
            got = f.get_tensor(name)
            assert _same_bits(got, expect), name
    # the masters are no longer quantized, and the exported config does not say they are: HF loads it as it is
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    assert all(_same_bits(loaded[name], expect) for name, expect in want.items())


def test_a_tensor_missing_in_every_form_is_named(tmp_path: Path, capsys) -> None:
    """Neither `gate_up_proj` nor its `_blocks` / `_scales`: the run stops before a step, naming the tensor and
    the pair that would have done."""
    src = tmp_path / "src"
    name = "model.layers.1.mlp.experts.gate_up_proj"
    quantized_checkpoint(src, drop=mxfp4.packed_names(name))
    capsys.readouterr()
    args = import_args(src, tmp_path / "run")
    assert cli.main(args) != 0
    err = capsys.readouterr().err
    assert (
        f"model.pretrained: tensor '{name}' (nor its MXFP4 pair '{name}_blocks', '{name}_scales') "
        "is missing from the checkpoint"
    ) in err, err
    assert "Traceback" not in err and not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize(
    "drop, lacks",
    [
        (  # half a pair: the other half is named
            ("model.layers.0.mlp.experts.down_proj_scales",),
            "'model.layers.0.mlp.experts.down_proj_scales' (the MXFP4 pair of "
            "'model.layers.0.mlp.experts.down_proj_blocks')",
        ),
        (  # not an expert matrix: no MXFP4 form to speak of
            ("model.layers.0.mlp.experts.down_proj_bias",),
            "'model.layers.0.mlp.experts.down_proj_bias' is missing",
        ),
    ],
)
def test_the_import_names_what_a_layer_lacks(tmp_path: Path, drop: tuple[str, ...], lacks: str) -> None:
    want = quantized_checkpoint(tmp_path, drop=drop)
    spec = build_spec(ModelConfig(family="gpt_oss", pretrained=str(tmp_path)))
    where = checkpoint_index(tmp_path)
    got = read_unit(spec, 2, where)  # layer 1 is whole
    assert all(_same_bits(t, want[spec.layout.hf_name(2, s)]) for s, t in got.items())
    with pytest.raises(ConfigError, match=r"model\.pretrained: tensor ") as info:
        read_unit(spec, 1, where)
    assert lacks in str(info.value)


def test_another_quantization_is_refused_by_name(tmp_path: Path) -> None:
    quantized_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ConfigError, match="quant_method 'gptq' is not supported"):
        build_spec(ModelConfig(family="gpt_oss", pretrained=str(tmp_path)))
