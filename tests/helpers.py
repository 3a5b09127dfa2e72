"""Shared test helpers: tiny HF models built from configs (no hub), direct weight sources and sinks."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.ipc.protocol import fetch_order
from megatrain.model import ModelConfig, ModelSpec, build_spec, family_classes
from megatrain.weights import flat_unit

# The GPU tests: marked cuda, skipped without a GPU (tests/conftest.py hides GPUs unless MEGATRAIN_TEST_CUDA=1).
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the suite hides it unless MEGATRAIN_TEST_CUDA=1)"
)
NEEDS_CUDA = [pytest.mark.cuda, requires_cuda]  # a module's pytestmark

# The bundled default shrunk to a model that starts and steps in moments: the launcher's arguments before a test's own
TINY_DEFAULT = [
    str(Path(__file__).resolve().parent.parent / "examples/default.yaml"),
    "model.hf.hidden_size=32",
    "model.hf.intermediate_size=64",
    "model.hf.num_hidden_layers=2",
    "data.seq_len=32",
    "data.batch_size=2",
]

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


# Mixture-of-experts families at test size: 4 experts, top-2, the load-balancing loss on with a coefficient
# large enough to move the weights; Qwen2-MoE with a shared expert and one dense layer, GPT-OSS with a
# sliding window shorter than the tests' sequences and sinks.
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]
_MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.05}
MOE_TINY = {
    "mixtral": {**_MOE, "num_local_experts": 4, "intermediate_size": 24, "sliding_window": None},
    "qwen2_moe": {
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {**_MOE, "num_experts": 4, "moe_intermediate_size": 24},
    "olmoe": {**_MOE, "num_experts": 4, "intermediate_size": 24, "pad_token_id": 0},
    "gpt_oss": {**_MOE, "num_local_experts": 4, "intermediate_size": 24, "head_dim": 8, "sliding_window": 8},
}


def started_since(before: set[int]) -> set[int]:
    """Processes this one has started since its descendants were `before` (and theirs), alive: not the workers
    that a Ray instance of the session (tests/conftest.py) starts on its own, whose parent, its raylet, is older."""
    import psutil

    new = {}
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            with contextlib.suppress(psutil.Error):
                new[p.pid] = p.ppid()
    found, parents = set(), {os.getpid()}
    while parents:
        parents = {pid for pid, ppid in new.items() if ppid in parents} - found
        found |= parents
    return found


def tiny_config_dict(family: str, tied: bool, layers: int = 3) -> dict:
    """model.hf for a tiny model of the family."""
    extra = {"sliding_window": None} if family == "mistral" else MOE_TINY.get(family, {})
    return {**TINY, "num_hidden_layers": layers, "tie_word_embeddings": tied, **extra}


def tiny_hf(family: str, tied: bool, layers: int = 3, seed: int = 0, hf: dict | None = None) -> torch.nn.Module:
    """A tiny model of the family; `hf`: config fields set over tiny_config_dict's."""
    conf_cls, model_cls = family_classes(family)
    conf = conf_cls(**{**tiny_config_dict(family, tied, layers), **(hf or {})})
    conf._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS has no SDPA path in HF
    torch.manual_seed(seed)
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


def import_args(src: Path, out: Path) -> list[str]:
    """megatrain-launch's arguments for a CPU run, in-process, of the bundled config started from the HF
    directory `src` (its config.json is the model), writing to `out`."""
    root = Path(__file__).resolve().parents[1]
    return [
        str(root / "examples/default.yaml"),
        f"model.pretrained={src}",
        "model.hf={}",
        "data.seq_len=32",
        "engine.device=cpu",
        f"train.output_dir={out}",
        "launch.runner=inprocess",
    ]


def guard_tree(root: int) -> int:
    """The launcher's own watchdog (launch/control/guard.py) over a process tree a test started in a session of
    its own (`ray start --head --block`): if this pytest process dies before its cleanup runs (SIGKILL, a
    timeout's SIGTERM), the watchdog ends the tree, which would otherwise outlive it. Its pid: SIGTERM it once
    the test has ended the tree itself."""
    from megatrain.ipc.procs import spawn_detached, start_ticks

    me = os.getpid()
    return spawn_detached("megatrain.launch.control.guard", str(me), str(start_ticks(me)), str(root))


def stop_guard(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def on_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Every call at once, one thread each (a group forms only when all its members are there); their
    results in order, or the first error raised."""
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("an executor's call did not return")
    return out
