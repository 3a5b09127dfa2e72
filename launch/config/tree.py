"""The one config tree. Each section is owned by its component; this module assembles and checks it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from megatrain.config.base import Where, key_error, load_located, section
from megatrain.config.data import BYTE_VOCAB_SIZE, DataConfig
from megatrain.config.engine import EngineConfig
from megatrain.config.ipc import IpcConfig
from megatrain.config.model import ModelConfig
from megatrain.config.optim import OptimConfig
from megatrain.errors import ConfigError
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.control.placement import ActorsConfig, batch_split_problem
from megatrain.launch.control.runners import LaunchConfig
from megatrain.model.arch import (
    Arch,
    accepted_fields,
    arch_from_config,
    hf_key_error,
    holds_weights,
    pretrained_config,
)
from megatrain.model.archfields import PLAIN_HEAD_DIM_ONLY
from megatrain.roster import slabs_refusal

# The sections, validate_tree and check_model import no torch, numba or transformers modeling code (tests/
# test_light_launcher.py): the checks that need the model (validate_model's others, check_gpu_budget) import
# it when they run, so loading the tree, `--help` and `plan` stay quick.


@dataclass
class Config:
    model: ModelConfig = section(ModelConfig, "The model: family, size, initialization.")
    data: DataConfig = section(DataConfig, "The training data.")
    optim: OptimConfig = section(OptimConfig, "AdamW, clipping and the LR schedule.")
    engine: EngineConfig = section(EngineConfig, "The executor's compute: device, dtype, checkpointing.")
    ipc: IpcConfig = section(IpcConfig, "Shared-memory staging and data-plane waits.")
    actors: ActorsConfig = section(ActorsConfig, "Worker processes and their threads.")
    train: TrainConfig = section(TrainConfig, "The run: steps, output, logging.")
    launch: LaunchConfig = section(LaunchConfig, "Ray or in-process transport, cluster address.")


def check_hf_keys(cfg: ModelConfig, where: Where | None = None) -> None:
    """model.hf keys must be fields of the family's HF config: HF configs keep unknown keys silently, so
    a typo would train another model than the one meant."""
    family, base = pretrained_config(cfg)
    valid = accepted_fields(family, base)
    for key in cfg.hf:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1)
            hint = f"; did you mean 'model.hf.{close[0]}'?" if close else ""
            raise key_error(where, f"model.hf.{key}", f"not a field of {family}'s HF config{hint}")


def validate(cfg: Config, where: Where | None = None) -> None:
    """Checks that span sections (each section checks itself when built)."""
    validate_tree(cfg, where)
    validate_model(cfg, where)


def validate_model(cfg: Config, where: Where | None = None, weights: bool = True) -> None:
    """Every check of the model: HF's own of its config (transformers' import: seconds), its attention run on
    the meta device, check_model's, a pretrained checkpoint's files and the GPU budget. The launcher runs them
    beside its Ray start (launch/prepare/inputs.py). `weights` False: a pretrained directory may hold config.json
    alone (made before the weights are downloaded)."""
    from megatrain.model.spec import build_spec, check_on_meta, resolve_hf_config
    from megatrain.model.weights import check_checkpoint

    check_hf_keys(cfg.model, where)
    arch_from_config(cfg.model, where)  # the shape fields whole and > 0, which HF's own check lets through
    resolve_hf_config(cfg.model, where)  # HF's strict fields: a value of the wrong type, named
    check_on_meta(cfg.model, cfg.engine.moe_experts, where)
    check_model(cfg, where)
    if cfg.model.pretrained and (weights or holds_weights(cfg.model.pretrained)):
        # every file whole, every parameter there in a layout read_unit reads, of its shape
        check_checkpoint(build_spec(cfg.model, cfg.optim.no_decay_1d), cfg.model.pretrained)
    check_gpu_budget(cfg, where)


def validate_plan(cfg: Config, where: Where | None = None) -> Arch:
    """The checks `megatrain-launch plan` makes: check_model's, with no torch; a pretrained checkpoint's files
    where the directory holds them already (it may hold config.json alone: planned before the download), and
    the GPU budget where one is set, which import the model code. HF's own check of the config and the meta
    attention wait for the run (validate_model), whose start they would cost seconds here."""
    arch = check_model(cfg, where)
    if cfg.model.pretrained and holds_weights(cfg.model.pretrained):
        from megatrain.model.spec import build_spec
        from megatrain.model.weights import check_checkpoint

        check_checkpoint(build_spec(cfg.model, cfg.optim.no_decay_1d), cfg.model.pretrained)
    check_gpu_budget(cfg, where)
    return arch


def check_model(cfg: Config, where: Where | None = None) -> Arch:
    """The model's checks that need no torch or transformers (`megatrain-launch plan` runs these alone): its
    fields against the family's (megatrain/model/arch.py) and the other sections; the model, described."""
    check_hf_keys(cfg.model, where)
    arch = arch_from_config(cfg.model, where, cfg.optim.no_decay_1d)
    hf = arch.fields

    def fail(key: str, msg: str) -> ConfigError:
        return key_error(where, key, msg)

    def fail_hf(key: str, msg: str) -> ConfigError:  # named where the value came from: model.hf or config.json
        return hf_key_error(cfg.model, where, key, msg)

    plain = arch.hidden_size // arch.num_attention_heads
    if arch.family in PLAIN_HEAD_DIM_ONLY and arch.head_dim != plain:
        msg = f"{arch.head_dim}: HF's {arch.family} attention takes only hidden_size / num_attention_heads"
        raise fail_hf("head_dim", f"{msg} ({plain}); leave head_dim out or set it to {plain}")
    if cfg.data.kind == "arithmetic" and arch.vocab_size < BYTE_VOCAB_SIZE:
        raise fail_hf("vocab_size", f"{arch.vocab_size} is below the byte tokenizer's {BYTE_VOCAB_SIZE}")
    if cfg.data.seq_len > hf["max_position_embeddings"]:
        raise fail(
            "data.seq_len", f"{cfg.data.seq_len} exceeds model max_position_embeddings {hf['max_position_embeddings']}"
        )
    dropout = [(k, v) for k, v in hf.items() if k.endswith("dropout") and isinstance(v, int | float) and v]
    if dropout:
        key, value = dropout[0]
        raise fail_hf(
            key,
            f"{value}: dropout is not supported: layers are computed again in their "
            "backward (checkpoint blocks, lean layers), which would draw other masks than "
            f"the forward did; set model.hf.{key}: 0",
        )
    jitter = hf.get("router_jitter_noise", 0.0)
    if jitter:  # Mixtral: a fresh uniform draw scales each MoE layer's input, in the layer's forward, for its routing
        raise fail_hf(
            "router_jitter_noise",
            f"{jitter}: router jitter noise is not supported: layers are computed again in their backward "
            "(checkpoint blocks, lean layers, token tiles), which would draw other noise and route the tokens "
            "otherwise than the forward did; set model.hf.router_jitter_noise: 0",
        )
    if cfg.engine.checkpoint_interval != "auto" and cfg.engine.checkpoint_interval > arch.num_layers:
        raise fail(
            "engine.checkpoint_interval",
            f"{cfg.engine.checkpoint_interval} exceeds the model's "
            f"{arch.num_layers} layers (model.hf.num_hidden_layers); "
            f"use at most {arch.num_layers}",
        )
    return arch


def gpu_budget_without_gpu(
    cfg: Config, remote: bool, gpus: int | None = None, place: str = "this machine"
) -> str | None:
    """engine.gpu_memory_gib is a GPU's budget: where engine.device auto finds no GPU, the run and `plan` alike
    refuse it (the message, key first), rather than train or plan the CPU with the budget ignored, or plan a GPU
    the run will not have. `remote`: the run joins a Ray cluster, whose nodes decide (None: they may have
    GPUs); `gpus`: this machine's (None: counted here), or those of `place` (the cluster's, once joined)."""
    if cfg.engine.gpu_memory_gib in (None, "auto") or cfg.engine.device != "auto" or remote:
        return None
    if gpus is None:
        from megatrain.memory.machine import local_gpus

        gpus = local_gpus()
    if gpus:
        return None
    return (
        f"engine.gpu_memory_gib: {cfg.engine.gpu_memory_gib} GiB is the budget of a GPU, but {place} has none "
        "(engine.device auto would train on the CPU): leave the key out to train on the CPU"
    )


def check_gpu_budget(cfg: Config, where: Where | None = None) -> None:
    """engine.gpu_memory_gib must hold the run's plan (explicit sizes included) before anything starts. Only
    where the run computes on a GPU: engine.device cuda, or auto on a machine with one."""
    if cfg.engine.gpu_memory_gib in (None, "auto") or cfg.engine.device == "cpu":
        return  # no budget (gpubudget.budget_bytes None): nothing to check, and the model code is not imported
    import torch

    from megatrain.config.engine import resolve_engine
    from megatrain.launch.control.placement import per_executor
    from megatrain.memory import budget as gpubudget
    from megatrain.memory.gpu import reduction_bytes
    from megatrain.model.spec import build_spec

    gpus = torch.cuda.device_count()
    if cfg.engine.device == "auto" and not gpus:
        return
    n = int(cfg.actors.num_gpus) if cfg.actors.num_gpus != "auto" else max(gpus, 1)
    spec = build_spec(cfg.model, cfg.optim.no_decay_1d)
    engine = resolve_engine(cfg.engine, True)
    batch = per_executor(cfg.data.batch_size, n)
    reserve = reduction_bytes(spec.layout) if n > 1 else 0
    problem = gpubudget.budget_problem(spec, engine, batch, cfg.data.seq_len, cfg.optim.clips, reserve)
    if problem:
        raise key_error(where, gpubudget.KEY, problem)


def validate_tree(cfg: Config, where: Where | None = None) -> None:
    """The cross-section checks that need no model code."""

    def fail(key: str, msg: str) -> ConfigError:
        return key_error(where, key, msg)

    if cfg.ipc.weight_slabs < cfg.actors.num_packers:
        raise fail(
            "ipc.weight_slabs",
            f"{cfg.ipc.weight_slabs} must be >= actors.num_packers "
            f"({cfg.actors.num_packers}): each packer owns at least one slab",
        )
    if cfg.ipc.grad_slabs < cfg.actors.num_accumulators:
        raise fail(
            "ipc.grad_slabs", f"{cfg.ipc.grad_slabs} must be >= actors.num_accumulators ({cfg.actors.num_accumulators})"
        )
    gpus, hosts = cfg.actors.num_gpus, cfg.actors.num_hosts
    split = batch_split_problem(cfg.data.batch_size, gpus) if gpus != "auto" else None
    if split:
        raise fail("data.batch_size", split)
    if hosts != "auto" and hosts > 1:
        every = hosts * (gpus if gpus != "auto" else 1)
        if cfg.data.batch_size < every:
            raise fail(
                "data.batch_size",
                f"{cfg.data.batch_size} is split by rows over the executors of actors.num_hosts {hosts} hosts "
                f"({every} at least): it must be at least that",
            )
    refusal = slabs_refusal(1 if gpus == "auto" else gpus, 1 if hosts == "auto" else hosts)
    if refusal and cfg.ipc.staging == "slabs":
        raise fail("ipc.staging", refusal)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    cfg, where = load_located(Config, path, overrides)
    validate(cfg, where)
    return cfg


def load_tree(path: str | Path | None, overrides: list[str] | None = None) -> tuple[Config, Where]:
    """The config with every check but validate_model's, and where each key came from (for those checks'
    messages, made later)."""
    cfg, where = load_located(Config, path, overrides)
    validate_tree(cfg, where)
    return cfg, where
