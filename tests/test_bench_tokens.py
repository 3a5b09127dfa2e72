"""bench/run.py's tokens and --routing uniform on the CPU: random token ids for a mixture of experts, the same
batches for MegaTrain's data path and the peers', and routers balanced on every layer in bf16 and fp32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench import run as bench_run
from bench.presets import MODELS
from bench.routing import uniform_model
from bench.tokens import batches, default_tokens, random_tokens
from megatrain.config.model import ModelConfig
from megatrain.data import DataConfig, open_data
from megatrain.launch.config.tree import load_config
from megatrain.layers.moe import moe_info
from megatrain.model.spec import family_classes, resolve_hf_config

SMALL = {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "head_dim": 16}
SMALL |= {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096}


def test_dense_presets_keep_arithmetic_and_experts_get_random_tokens(tmp_path: Path) -> None:
    for model, (_, shape, _) in MODELS.items():
        moe = "num_experts_per_tok" in shape
        assert default_tokens(bench_run.bench_model(model, 2, [])[0]) == ("random" if moe else "arithmetic"), model
    args = bench_run.parse(["--out", str(tmp_path), "--layers", "1"])
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    assert args.tokens is None and not [
        o for o in bench_run.overrides(args, tmp_path, extra) if o.startswith(("data.kind", "data.path"))
    ]
    assert load_config(None, bench_run.overrides(args, tmp_path, extra)).data.kind == "arithmetic"


def test_random_tokens_are_the_same_batches_for_megatrain_and_the_peers(tmp_path: Path) -> None:
    """MegaTrain's batch t of 2 GPUs x 3 sequences (its config through bench/run.py's overrides) is the peers' batches
    2t and 2t+1 of 3 (DeepSpeed's ranks 0 and 1), and the plain peer's batch t of 3 is MegaTrain's one-GPU batch t."""
    argv = ["--out", str(tmp_path), "--model", "olmoe-1b-7b", "--layers", "1", "--batch", "3", "--seq", "16"]
    args = bench_run.parse(
        [*argv, "--gpus", "2", "--steps", "4", "--peers", "deepspeed", "--extra", "model.hf.vocab_size=70000"]
    )
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    args.data = random_tokens(args.hf["vocab_size"], DataConfig(seq_len=16, batch_size=6), args.steps, tmp_path)
    assert args.data.token_dtype == "uint32"  # a vocabulary over 65536 ids
    cfg = load_config(None, bench_run.overrides(args, tmp_path, extra))
    _, hf = resolve_hf_config(cfg.model)
    ours = open_data(cfg.data, hf, None)
    peer = batches(dataclasses.replace(args.data, batch_size=3), hf)
    seen = []
    for t in range(args.steps):
        b = ours.batch(t)
        assert b.ids.shape == (6, 16) and torch.equal(b.ids, b.labels)
        assert torch.equal(b.ids, torch.cat([peer(2 * t)[0], peer(2 * t + 1)[0]]))
        seen.append(b.ids)
    one = open_data(load_config(None, bench_run.overrides(args, tmp_path, extra, gpus=1)).data, hf, None)
    assert all(torch.equal(one.batch(t).ids, peer(t)[0]) for t in range(args.steps))
    ids = torch.cat(seen)
    assert ids.unique().numel() > 300 and int(ids.max()) < 70000  # spread over the vocabulary, inside it


def _loads(model_dir: Path, family: str, ids: torch.Tensor, dtype: torch.dtype) -> list[float]:
    """Busiest expert's top-k rows over the mean, per layer, as HF's routers choose them in `dtype`."""
    model = family_classes(family)[1].from_pretrained(str(model_dir), dtype=dtype).eval()
    loads = []

    def hook(router: torch.nn.Module, args: tuple, out: tuple) -> None:
        n = torch.bincount(out[-1].reshape(-1), minlength=router.weight.shape[0]).float()
        loads.append(float(n.max() / n.mean()))

    router = moe_info(model).router
    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return loads


@pytest.mark.parametrize("preset", ["olmoe-1b-7b", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_uniform_routing_is_even_on_every_layer_in_bf16_and_fp32(preset: str, tmp_path: Path) -> None:
    """The preset's experts and top-k on a narrow model of 3 layers, random tokens: HF's random init routes
    unevenly by the last layer, the balanced init within 1.5x an even share on every layer, in bf16 and fp32."""
    family, shape, _ = MODELS[preset]
    _, hf = resolve_hf_config(ModelConfig(family=family, hf={**shape, **SMALL, "num_hidden_layers": 3}))
    data = random_tokens(hf.vocab_size, DataConfig(seq_len=128, batch_size=4), 1, tmp_path)
    ids = batches(data, hf)(0)[0]
    balanced = uniform_model(hf, data, 1, where=tmp_path / "uniform")
    torch.manual_seed(0)
    family_classes(family)[1](hf).save_pretrained(tmp_path / "random")
    assert max(_loads(tmp_path / "random", family, ids, torch.float32)) > 1.5
    for dtype in (torch.float32, torch.bfloat16):
        loads = _loads(balanced, family, ids, dtype)
        assert len(loads) == 3 and max(loads) <= 1.5, (dtype, loads)
