"""`model.hf.head_dim` other than hidden_size / heads, for every family whose HF attention takes one: accepted
from a config file, and honoured by the parameters, the FLOPs, the memory plan, the engine (against HF autograd)
and the export; refused by name for OLMoE, whose HF attention norms q and k over hidden_size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain.data import DataConfig, batch
from megatrain.errors import ConfigError
from megatrain.flops import active_params, model_step_flops
from megatrain.formats.export import export
from megatrain.launch.config import memplan
from megatrain.launch.config.tree import load_config
from megatrain.memory.autosize import layer_activation_bytes
from megatrain.memory.layer import lean_layer_bytes
from megatrain.model.arch import arch_of_spec
from megatrain.model.spec import FAMILIES, ModelSpec, build_spec, hf_config_fields
from megatrain.model.weights import flat_unit
from tests.harness import TINY, tiny_config_dict
from tests.model_fixtures import check_grads, engine_step, tiny_hf

WIDE = 16  # TINY's heads are hidden_size / heads = 8 wide: twice that
PLAIN = TINY["hidden_size"] // TINY["num_attention_heads"]
WIDE_FAMILIES = sorted(set(FAMILIES) - {"olmoe"})


def _yaml(tmp_path: Path, family: str, head_dim: int) -> Path:
    """A config file that sets model.hf.head_dim, on its last line."""
    hf = {k: v for k, v in tiny_config_dict(family, tied=False).items() if k != "head_dim"}
    lines = ["model:", f"  family: {family}", "  hf:", *(f"    {k}: {json.dumps(v)}" for k, v in hf.items())]
    path = tmp_path / f"{family}-{head_dim}.yaml"
    path.write_text("\n".join([*lines, f"    head_dim: {head_dim}"]) + "\n")
    return path


def _spec_from_yaml(tmp_path: Path, family: str, head_dim: int) -> ModelSpec:
    """The spec of a config file that sets model.hf.head_dim, through every check a run makes."""
    return build_spec(load_config(_yaml(tmp_path, family, head_dim)).model)


def test_every_family_takes_head_dim_and_olmoe_only_its_own(tmp_path: Path) -> None:
    """head_dim is a field of every family (their HF attention reads it). HF's OLMoE norms q and k over
    hidden_size, so another head_dim would fail its first step: refused, naming the file, line and key."""
    assert all("head_dim" in hf_config_fields(f) for f in FAMILIES)
    assert _spec_from_yaml(tmp_path, "olmoe", PLAIN).hf_config.head_dim == PLAIN
    path = _yaml(tmp_path, "olmoe", WIDE)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    line = len(path.read_text().splitlines())
    assert str(err.value).startswith(f"{path}:{line}: config key 'model.hf.head_dim': {WIDE}: HF's olmoe attention")
    assert f"leave head_dim out or set it to {PLAIN}" in str(err.value)


@pytest.mark.parametrize("value", ["0", "-8", "1.5"])
def test_a_head_dim_that_is_no_width_is_a_usage_error_naming_the_key(value: str, capsys) -> None:
    """0 read as "absent" and planned; -8 and 0 failed in HF's attention as internal errors (exit 1). Now the
    plan and the run refuse each alike: exit 2, one line naming model.hf.head_dim."""
    from megatrain.launch.cli.main import main

    default = str(Path(__file__).parents[1] / "examples" / "default.yaml")
    for argv in (["plan", default], [default, "--print-config"]):  # --print-config: every check a run makes
        assert main([*argv, f"model.hf.head_dim={value}"]) == 2, argv
        err = capsys.readouterr().err
        assert f"config key 'model.hf.head_dim': {value}: must be a whole number > 0" in err, err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("family", WIDE_FAMILIES)
def test_head_dim_is_accepted_and_counted(tmp_path: Path, family: str) -> None:
    """The parameters are HF's model's, and the FLOPs' attention term and every activation estimate of the
    plan grow by the wider q, attention output, k and v."""
    wide, plain = _spec_from_yaml(tmp_path, family, WIDE), _spec_from_yaml(tmp_path, family, PLAIN)
    assert wide.hf_config.head_dim == WIDE
    model = tiny_hf(family, tied=False, hf={"head_dim": WIDE})
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == WIDE * TINY["num_attention_heads"]
    assert wide.layout.num_params == sum(p.numel() for p in model.parameters())
    assert wide.layout.num_params > plain.layout.num_params

    layers, seq, rows = TINY["num_hidden_layers"], 64, 2
    tokens = rows * seq
    q = WIDE * TINY["num_attention_heads"]
    want = 6 * active_params(wide) * tokens + 12 * layers * q * seq * tokens
    assert model_step_flops(wide, rows, seq) == want

    extra = 2 * (WIDE - PLAIN) * (TINY["num_attention_heads"] + TINY["num_key_value_heads"])  # per token
    numel = max(wide.layout.structure_of(u.index).numel for u in wide.layout.units if u.kind == "layer")
    assert layer_activation_bytes(wide, tokens, 2) - layer_activation_bytes(plain, tokens, 2) == tokens * extra * 2
    tiled = layer_activation_bytes(wide, tokens, 2, 32) - layer_activation_bytes(plain, tokens, 2, 32)
    assert tiled == (tokens + 32) * extra * 2  # the attention half kept, and the tile in flight
    lean = lean_layer_bytes(arch_of_spec(wide), tokens, 2, numel) - lean_layer_bytes(
        arch_of_spec(plain), tokens, 2, numel
    )
    assert lean == tokens * extra * 2


@pytest.mark.parametrize("family", WIDE_FAMILIES)
@pytest.mark.parametrize("case", ["k1", "k2-last1-chunks2", "tiles", "lean"])
def test_head_dim_trains_as_hf_does(family: str, case: str) -> None:
    """The engine's loss and every unit's gradient equal HF autograd's over the same wide-headed model."""
    model = tiny_hf(family, tied=False, hf={"head_dim": WIDE})
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)  # HF adds coef * aux to a mixture of experts' loss; the engine does not
    ref = float(out.loss.detach()) - (0.0 if aux is None else model.config.router_aux_loss_coef * float(aux.detach()))
    spec, res, sink = engine_step(model, family, case, ids, labels)
    assert spec.hf_config.head_dim == WIDE
    assert abs(float(res.loss) - ref) <= 1e-6 * abs(ref)
    check_grads(spec, sink, {k: p.grad for k, p in model.named_parameters()})


@pytest.mark.parametrize("family", WIDE_FAMILIES)
def test_head_dim_survives_the_export(tmp_path: Path, family: str, capsys) -> None:
    """The exported config.json keeps head_dim, so from_pretrained builds the same model and computes the
    same logits from the exported weights."""
    spec = _spec_from_yaml(tmp_path, family, WIDE)
    model = tiny_hf(family, tied=False, hf={"head_dim": WIDE}).eval()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = export(spec, lambda u: flat_unit(spec, u, state), tmp_path / "hf")
    capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["head_dim"] == WIDE
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    loaded.config._attn_implementation = model.config._attn_implementation
    ids = batch(DataConfig(seq_len=24, batch_size=2), 0)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_qwen3_30b_a3b_is_planned_at_its_size() -> None:
    """Qwen3-30B-A3B's published config (head_dim 128 at hidden_size 2048 and 32 heads): 30.53B parameters,
    3.35B active; hidden_size / heads would plan 30.08B."""
    hf = {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    }
    cfg = load_config(None, ["model.family=qwen3_moe", f"model.hf={json.dumps(hf)}", "engine.device=cpu"])
    plan = memplan.make_plan(cfg, None, cuda=False)
    assert (plan.num_params, plan.active_params) == (30_532_122_624, 3_353_032_704)
