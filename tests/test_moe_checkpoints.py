"""model.pretrained with mixture-of-experts checkpoints in each layout transformers 5 reads: the published
per-expert one (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen2-MoE's, Qwen3-MoE's and OLMoE's
`mlp.experts.{e}.gate_proj/up_proj/down_proj`), which is also what transformers' own save_pretrained writes,
and the 3D one the model holds in memory (`mlp.experts.gate_up_proj` / `down_proj`; GPT-OSS's only layout
besides MXFP4, tests/test_mxfp4_import.py). Each is written here by hand with safetensors, imported through
the run (the store owner fills the fp32 masters), written out with train.save_final and loaded back with
from_pretrained: every tensor equals the source's, bit for bit (bf16 sources: their bf16 values). A checkpoint
that lacks an expert's tensor, or holds one of another shape, is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from megatrain.errors import ConfigError
from megatrain.launch.cli import main as cli
from megatrain.model.spec import ModelConfig, build_spec
from megatrain.model.weights import check_checkpoint, checkpoint_index, read_unit
from tests.harness import MOE_FAMILIES, import_args
from tests.harness import train_tiny as run
from tests.model_fixtures import tiny_hf

SPECIAL = {
    "qwen2_moe": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight",
    ),
    "gpt_oss": ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias", "self_attn.sinks"),
}


def hub_layout(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors under the names the family's published checkpoints use (e.g.
    mistralai/Mixtral-8x7B-v0.1: `model.layers.0.block_sparse_moe.gate.weight`,
    `model.layers.0.block_sparse_moe.experts.0.w1.weight`), split per expert by hand: in memory each expert's
    gate rows come before its up rows in gate_up_proj [E, 2·I, H]. GPT-OSS is published with the 3D names."""
    if family == "gpt_oss":
        return dict(state)
    block, gate, up, down = (
        ("block_sparse_moe", "w1", "w3", "w2") if family == "mixtral" else ("mlp", "gate_proj", "up_proj", "down_proj")
    )
    out = {}
    for name, t in state.items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = t
        elif rest == "experts.gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{gate}.weight"] = t[e, :half]
                out[f"{layer}.{block}.experts.{e}.{up}.weight"] = t[e, half:]
        elif rest == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{down}.weight"] = t[e]
        else:
            out[f"{layer}.{block}.{rest}"] = t
    return out


def write_checkpoint(root: Path, config, tensors: dict[str, torch.Tensor], shard_bytes: int = 0) -> dict[str, str]:
    """config.json and the tensors, as model.safetensors or (shard_bytes) in shards of about that size with
    model.safetensors.index.json, in the order given; returns the index's weight_map."""
    root.mkdir(parents=True)
    config.save_pretrained(root)
    shards, size = [[]], 0
    for name, t in tensors.items():
        if shard_bytes and shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if not shard_bytes:
        files = ["model.safetensors"]
    weight_map = {}
    for file, names in zip(files, shards):
        save_file({n: tensors[n].contiguous() for n in names}, root / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if shard_bytes:
        total = sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_transformers_save_pretrained_writes_the_published_layout(tmp_path: Path) -> None:
    """transformers 5 holds the experts in 3D but its save_pretrained splits them per expert again (its
    conversion mapping, reversed), under the published names; GPT-OSS it writes in 3D. The import's reader
    takes its sharded directories (a layer's experts in two files) as they are."""
    split = []
    for family in MOE_FAMILIES:
        model = tiny_hf(family, tied=False, layers=2)
        model.save_pretrained(tmp_path / family, max_shard_size="50KB")
        weight_map = json.loads((tmp_path / family / "model.safetensors.index.json").read_text())["weight_map"]
        state = model.state_dict()
        assert set(weight_map) == set(hub_layout(family, state)), family
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        per_expert = family != "gpt_oss"
        assert ("model.layers.0.mlp.experts.gate_up_proj" in weight_map) != per_expert, family
        for layer in range(2):
            if len({f for n, f in weight_map.items() if n.startswith(f"model.layers.{layer}.") and "experts" in n}) > 1:
                split.append(family)
        spec = build_spec(ModelConfig(family=family, pretrained=str(tmp_path / family)))
        check_checkpoint(spec, tmp_path / family)
        where = checkpoint_index(tmp_path / family)
        for u in spec.layout.units:
            for slot, t in read_unit(spec, u.index, where).items():
                assert torch.equal(t, state[spec.layout.hf_name(u.index, slot)]), (family, slot)
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"} <= set(split), split  # a layer's experts in two files
    # as mistralai/Mixtral-8x7B-v0.1 names them: the router and the experts under block_sparse_moe
    mixtral = json.loads((tmp_path / "mixtral" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in mixtral
    assert not any(".mlp." in n for n in mixtral)


@pytest.mark.parametrize("layout", ["published, bf16, sharded", "3D, fp32"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_layout_imports_into_the_fp32_masters_exactly(tmp_path: Path, family: str, layout: str) -> None:
    model = tiny_hf(family, tied=False, layers=2)
    if layout.startswith("published"):
        model = model.to(torch.bfloat16)
    source = model.state_dict()
    src = tmp_path / "src"
    if layout.startswith("published"):
        tensors = hub_layout(family, source)
        # about a third of a layer's experts in each shard: one layer's experts are split across files
        weight_map = write_checkpoint(src, model.config, tensors, shard_bytes=6000)
        files = {f for n, f in weight_map.items() if n.startswith("model.layers.0.") and ".experts." in n}
        assert len(files) > 1, files
    else:
        tensors = source
        write_checkpoint(src, model.config, tensors)
    for suffix in SPECIAL.get(family, ()):
        assert any(n.endswith(suffix) for n in tensors), suffix

    run(tmp_path / "run", family, f"model.pretrained={src}", "model.hf={}", "train.save_final=true", steps=0)
    final = tmp_path / "run" / "final"
    # the export writes the layout transformers' save_pretrained writes (the test above)
    assert set(checkpoint_index(final)) == set(hub_layout(family, source))
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    assert set(loaded) == set(source)
    for name, t in source.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t.float()), name


def test_mixtral_under_either_block_name(tmp_path: Path) -> None:
    """transformers 5 renames Mixtral's `block_sparse_moe.` to `mlp.` before it merges the experts, so it
    reads per-expert tensors under `mlp.` and 3D ones under `block_sparse_moe.` too; so does the import."""
    model = tiny_hf("mixtral", tied=False, layers=2)
    source = model.state_dict()
    variants = {
        "per-expert-under-mlp": {
            k.replace(".block_sparse_moe.", ".mlp."): v for k, v in hub_layout("mixtral", source).items()
        },
        "3d-under-block_sparse_moe": {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in source.items()},
    }
    for tag, tensors in variants.items():
        src = tmp_path / tag
        write_checkpoint(src, model.config, tensors)
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
        assert all(torch.equal(hf[n], t) for n, t in source.items()), tag
        spec = build_spec(ModelConfig(family="mixtral", pretrained=str(src)))
        check_checkpoint(spec, src)
        where = checkpoint_index(src)
        for u in spec.layout.units:
            for slot, t in read_unit(spec, u.index, where).items():
                assert torch.equal(t, source[spec.layout.hf_name(u.index, slot)]), (tag, slot)


def _drop(name: str):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return edit


def _first_row(name: str):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:1]  # would broadcast into the expert's rows if copied in unchecked

    return edit


W3 = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "family, edit, unit, words",
    [
        ("mixtral", _drop(W3), 2, f"tensor '{W3}' (expert 2 of '{GATE_UP}') is missing from the checkpoint"),
        (
            "mixtral",
            _first_row(W3),
            2,
            f"tensor '{W3}' (expert 2 of '{GATE_UP}') has shape (1, 32), the model config expects (24, 32)",
        ),
        (
            "qwen3_moe",
            lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.0.mlp.experts.") and "down_proj" in k],
            1,
            "tensor 'model.layers.0.mlp.experts.down_proj' (nor per expert, as "
            "'model.layers.0.mlp.experts.0.down_proj.weight' and the like) is missing from the checkpoint",
        ),
    ],
    ids=["missing", "misshapen", "no-expert-at-all"],
)
def test_a_checkpoint_without_an_expert_is_refused_in_one_line(
    tmp_path: Path, capsys, family: str, edit, unit: int, words: str
) -> None:
    """Through megatrain-launch: exit 2 (the user's input), one line naming the tensor, nothing started."""
    model = tiny_hf(family, tied=False, layers=2)
    tensors = hub_layout(family, model.state_dict())
    edit(tensors)
    src = tmp_path / "src"
    write_checkpoint(src, model.config, tensors)
    capsys.readouterr()
    args = import_args(src, tmp_path / "run")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    # the line names where model.pretrained was set (here: the command line), then the tensor
    assert err == f"megatrain-launch: error: command line 'model.pretrained={src}': model.pretrained: {words}\n", err
    assert not (tmp_path / "run").exists()
    # the store owner's reader names it too, should the files change after the check
    spec = build_spec(ModelConfig(family=family, pretrained=str(src)))
    with pytest.raises(ConfigError, match=r"^model\.pretrained: tensor ") as info:
        read_unit(spec, unit, checkpoint_index(src))
    assert words.removeprefix("tensor ") in str(info.value)
