"""The one config tree. Each section is owned by its component; this module assembles and checks it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatrain.ipc.protocol import IpcConfig
from megatrain.launch.driver_config import TrainConfig
from megatrain.launch.placement import ActorsConfig
from megatrain.launch.runners import LaunchConfig

from megatrain.adamw import OptimConfig
from megatrain.configbase import load, section
from megatrain.data import ByteTokenizer, DataConfig
from megatrain.engine import EngineConfig
from megatrain.errors import ConfigError
from megatrain.model import ModelConfig, resolve_hf_config


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


def validate(cfg: Config) -> None:
    """Checks that span sections (each section checks itself when built)."""
    _, hf = resolve_hf_config(cfg.model)
    if cfg.data.kind == "arithmetic" and hf.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"model.hf.vocab_size {hf.vocab_size} is below the byte tokenizer's "
                          f"{ByteTokenizer.vocab_size}")
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    if window and cfg.data.seq_len > window:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds the model's sliding_window {window}; "
                          "sliding-window attention is not implemented (set model.hf.sliding_window: null)")
    if cfg.data.seq_len > hf.max_position_embeddings:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds model max_position_embeddings "
                          f"{hf.max_position_embeddings}")
    if cfg.engine.checkpoint_interval > hf.num_hidden_layers:
        raise ConfigError(f"engine.checkpoint_interval {cfg.engine.checkpoint_interval} exceeds the model's "
                          f"{hf.num_hidden_layers} layers (model.hf.num_hidden_layers); use at most "
                          f"{hf.num_hidden_layers}")
    if cfg.ipc.weight_slabs < cfg.actors.num_packers:
        raise ConfigError(f"ipc.weight_slabs ({cfg.ipc.weight_slabs}) must be >= actors.num_packers "
                          f"({cfg.actors.num_packers}): each packer owns at least one slab")
    if cfg.ipc.grad_slabs < cfg.actors.num_accumulators:
        raise ConfigError(f"ipc.grad_slabs ({cfg.ipc.grad_slabs}) must be >= actors.num_accumulators "
                          f"({cfg.actors.num_accumulators})")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    cfg = load(Config, path, overrides)
    validate(cfg)
    return cfg
