"""Mixture-of-experts families (megatrain/moe.py): the engine's loss, load-balancing loss and every unit's
gradient equal HF autograd over the whole model, with the aux loss's cross-layer statistics."""

from __future__ import annotations

import pytest
import torch

from megatrain.data import DataConfig, batch
from megatrain.engine import EngineConfig, StepEngine, fixed_sizes
from megatrain.ipc.protocol import blocks, fetch_order, grad_order
from megatrain.launch.fidelity import compare
from megatrain.weights import flat_unit
from tests.helpers import MOE_FAMILIES, DictSink, DictSource, spec_for, tiny_hf
from tests.test_equivalence import check, tiny_config


def _reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    lm = float(out.loss.detach()) - model.config.router_aux_loss_coef * float(out.aux_loss.detach())
    return lm, float(out.aux_loss.detach()), {k: p.grad for k, p in model.named_parameters()}


ENGINE_CASES = {
    "k1": dict(checkpoint_interval=1),
    "k2-last1-chunks2": dict(checkpoint_interval=2, last_block_layers=1, chunk_sequences=2),
    "one-block-chunks1": dict(checkpoint_interval=3, chunk_sequences=1),
    "one-block": dict(checkpoint_interval=3),
    "tiles": dict(checkpoint_interval=2, token_tile=10),  # routing per tile, again in the tiles' backward
    "lean": dict(checkpoint_interval=1, last_block_layers=3, lean_layers=2),  # routing again in the recompute
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_moe_engine_matches_hf_autograd(family: str, case: str) -> None:
    """One block counts its routing in the forward with grad; sequence chunks run the last block per
    chunk, which needs every chunk's routing counted before the first chunk's backward."""
    model = tiny_hf(family, tied=False)
    spec = spec_for(model, family)
    ids, labels = batch(DataConfig(seq_len=24, batch_size=3), 0)
    ref_lm, ref_aux, ref_grads = _reference(model, ids, labels)
    state = {k_: v.detach() for k_, v in model.state_dict().items()}

    cfg = fixed_sizes(EngineConfig(loss_chunk_tokens=10, **ENGINE_CASES[case]))
    k, last = cfg.checkpoint_interval, cfg.last_block_layers
    n = spec.layout.num_layers
    engine = StepEngine(spec, cfg, torch.device("cpu"), torch.float32)
    src, sink = DictSource(spec, state, blocks=blocks(n, k, last)), DictSink()
    res = engine.step(ids, labels, src, sink)

    assert src.seen == fetch_order(blocks(n, k, last))
    assert sink.order == grad_order(n)
    assert abs(float(res.loss) - ref_lm) <= 1e-6 * abs(ref_lm)
    assert abs(float(res.routers.aux_loss()) - ref_aux) <= 1e-6 * abs(ref_aux)
    load = res.routers.load()
    assert all(sum(row) == ids.numel() * 2 for row in load)  # every token routed to top-2
    for unit in range(n + 2):
        want = flat_unit(spec, unit, ref_grads)
        got = sink.grads[unit][: want.numel()]
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), unit


SYSTEM_CASES = [
    ("mixtral", True, 2, ["engine.chunk_sequences=3"]),  # the last block per chunk: routing counted first
    ("qwen2_moe", False, 1, ["optim.max_grad_norm=0", "ipc.staging=resident"]),
    ("qwen3_moe", False, 3, ["actors.num_packers=2", "actors.num_accumulators=2", "ipc.weight_slabs=3"]),
    ("olmoe", True, 1, ["engine.last_block_layers=3", "engine.lean_layers=2", "optim.max_grad_norm=0"]),
    ("gpt_oss", False, 2, []),
]


@pytest.mark.parametrize("family,tied,k,extra", SYSTEM_CASES, ids=[c[0] for c in SYSTEM_CASES])
def test_moe_through_the_actor_system_matches_plain_pytorch(
    tmp_path, family: str, tied: bool, k: int, extra: list[str]
) -> None:
    """10 steps through every actor (in-process runner) against the HF model + torch.optim.AdamW: the
    language-model loss and the load-balancing loss per step, and the final weights (exported per expert
    as HF writes them, read back), to 1e-5; the metrics carry each layer's expert load."""
    rep = compare(tiny_config(family, tied, k, tmp_path, extra=extra), tmp_path)
    check(rep, tied)
    assert len(rep["aux_losses"]) == 10
    for step, (ours, ref) in enumerate(zip(rep["aux_losses"], rep["ref_aux_losses"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"step {step + 1}: aux {ours} vs {ref}"
    load = rep["summary"]["metrics"][-1]["expert_load"]
    moe_layers = 2 if family == "qwen2_moe" else 3  # its layer 1 is dense (mlp_only_layers)
    assert len(load) == moe_layers and all(sum(row) == 4 * 32 * 2 and len(row) == 4 for row in load)
