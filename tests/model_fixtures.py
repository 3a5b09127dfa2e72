"""Tiny models for the tests that check the engine against HF without the actor system: HF models built from
configs (no hub), direct weight sources and sinks, one engine step, MoE blocks, packed documents."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from megatrain.data import IGNORE
from megatrain.ipc.protocol import blocks, fetch_order, grad_order
from megatrain.layers.experts import EXPERTS, Experts
from megatrain.model.spec import ModelConfig, ModelSpec, build_spec, family_classes
from megatrain.model.weights import flat_unit
from megatrain.step.engine import EngineConfig, StepEngine, fixed_sizes
from tests.harness import TINY, tiny_config_dict


def tiny_hf(family: str, tied: bool, layers: int = 3, seed: int = 0, hf: dict | None = None) -> torch.nn.Module:
    """A tiny model of the family; `hf`: config fields set over tiny_config_dict's."""
    conf_cls, model_cls = family_classes(family)
    conf = conf_cls(**{**tiny_config_dict(family, tied, layers), **(hf or {})})
    conf._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS has no SDPA path in HF
    torch.manual_seed(seed)
    return model_cls(conf).float()


def windowed_hf(family: str, window: int, layers: int = 3, max_window_layers: int = 0) -> torch.nn.Module:
    """A tiny Mistral or Qwen2 with sliding-window attention (Qwen2's layers below max_window_layers full)."""
    conf_cls, model_cls = family_classes(family)
    extra = {"sliding_window": window}
    if family == "qwen2":
        extra.update(use_sliding_window=True, max_window_layers=max_window_layers)
    conf = conf_cls(**{**TINY, "num_hidden_layers": layers, "tie_word_embeddings": False, **extra})
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(conf).float()


def spec_for(model: torch.nn.Module, family: str) -> ModelSpec:
    hf = model.config.to_dict()
    for k in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        hf.pop(k, None)
    return build_spec(ModelConfig(family=family, hf=hf))


class DictSource:
    """Serves unit weights from an HF state dict; with a plan's `blocks`, checks the fetch order against it."""

    def __init__(
        self, spec: ModelSpec, state: dict, order: list[int] | None = None, blocks: list[list[int]] | None = None
    ):
        self.spec, self.state, self.seen = spec, state, []
        self.blocks = blocks or []
        self.order = order if order is not None else (fetch_order(blocks) if blocks else None)

    def fetch(self, unit: int) -> torch.Tensor:
        if self.order is not None:
            assert unit == self.order[len(self.seen)], (unit, len(self.seen))
        self.seen.append(unit)
        return flat_unit(self.spec, unit, self.state)


class DictSink:
    def __init__(self):
        self.grads: dict[int, torch.Tensor] = {}
        self.order: list[int] = []

    def emit(self, unit: int, grad: torch.Tensor) -> None:
        assert unit not in self.grads, f"unit {unit} emitted twice"
        self.order.append(unit)
        self.grads[unit] = grad.detach().float().clone()


# ---- one engine step against HF autograd (the MoE, head-dim and CUDA engine tests) -------------------
ENGINE_CASES = {
    "k1": dict(checkpoint_interval=1),
    "k2-last1-chunks2": dict(checkpoint_interval=2, last_block_layers=1, chunk_sequences=2),
    "one-block-chunks1": dict(checkpoint_interval=3, chunk_sequences=1),
    "one-block": dict(checkpoint_interval=3),
    "tiles": dict(checkpoint_interval=2, token_tile=10),  # routing per tile, again in the tiles' backward
    "lean": dict(checkpoint_interval=1, last_block_layers=3, lean_layers=2),  # routing again in the recompute
}


def engine_step(
    model: torch.nn.Module, family: str, case: str, ids: torch.Tensor, labels: torch.Tensor, experts: str = "hf"
):
    """One engine step over the model's weights, the fetch and gradient order checked: (spec, result, sink)."""
    spec = spec_for(model, family)
    state = {k_: v.detach() for k_, v in model.state_dict().items()}
    cfg = fixed_sizes(EngineConfig(loss_chunk_tokens=10, moe_experts=experts, **ENGINE_CASES[case]))
    k, last = cfg.checkpoint_interval, cfg.last_block_layers
    n = spec.layout.num_layers
    engine = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    src, sink = DictSource(spec, state, blocks=blocks(n, k, last)), DictSink()
    with our_experts_run(experts):
        res = engine.step(ids, labels, src, sink)
    assert src.seen == fetch_order(blocks(n, k, last))
    assert sink.order == grad_order(n)
    return spec, res, sink


@contextlib.contextmanager
def our_experts_run(experts: str):
    """Checks that the step ran its experts on the path engine.moe_experts names (megatrain/layers/experts.py or
    not)."""
    calls: list[int] = []
    apply = Experts.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Experts, "apply", lambda *a: calls.append(1) or apply(*a))
        yield
    assert bool(calls) == (experts == "megatrain")


def check_grads(spec, sink: DictSink, ref_grads: dict) -> None:
    for unit in range(spec.layout.num_layers + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()]
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), unit


# ---- one MoE block, HF's eager experts beside ours -----------------------------------------------
EXPERT_HIDDEN = 64


def expert_config(family: str, width: int, k: int, num_experts: int = 8, **extra):
    fields = {
        "mixtral": dict(intermediate_size=width, num_local_experts=num_experts),
        "qwen2_moe": dict(moe_intermediate_size=width, shared_expert_intermediate_size=48, num_experts=num_experts),
        "qwen3_moe": dict(moe_intermediate_size=width, num_experts=num_experts),
        "olmoe": dict(intermediate_size=width, num_experts=num_experts),
        "gpt_oss": dict(intermediate_size=width, num_local_experts=num_experts),
    }[family]
    conf = family_classes(family)[0](
        hidden_size=EXPERT_HIDDEN, num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=4, **fields, **extra
    )
    conf._experts_implementation = "eager"
    return conf


def expert_blocks(family: str, width: int = 32, k: int = 2, std: float = 0.1, bias_std: float = 0.5, **extra):
    """(HF's eager block, the same block on our path), same weights."""
    conf = expert_config(family, width, k, **extra)
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = family_classes(family)[1](conf).model.layers[0]
    ref = layer.mlp.to_empty(device="cpu")
    for name, p in ref.named_parameters():
        torch.nn.init.normal_(p, std=bias_std if "bias" in name else std)
    ours = copy.deepcopy(ref)
    ours.experts.config = copy.deepcopy(conf)
    ours.experts.config._experts_implementation = EXPERTS
    return ref, ours


# ---- packed documents, against the HF model run one document at a time --------------------------
DOCS = [[5, 11, 1, 7], [13, 2, 9]]  # two rows of 24 tokens; 11 and 13 and 9 are longer than the window of 6


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (2, 24), generator=g)
    pos = torch.tensor([[p for n in row for p in range(n)] for row in DOCS])
    labels = ids.clone()
    labels[:, 1:][pos[:, 1:] == 0] = IGNORE  # what the data path does at every document start
    return ids, labels, pos


def hf_one_by_one(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The token losses of every document run on its own through the HF model, summed, over the packed
    batch's labelled tokens (position j predicts labels[j + 1]; a document's last token predicts nothing)."""
    total = torch.zeros(())
    for r, row in enumerate(DOCS):
        s = 0
        for n in row:
            logits = model(input_ids=ids[r : r + 1, s : s + n]).logits[0].float()
            total = total + F.cross_entropy(logits[:-1], labels[r, s + 1 : s + n], ignore_index=IGNORE, reduction="sum")
            s += n
    loss = total / (labels[:, 1:] != IGNORE).sum()
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}
