"""The bench's workload: the model every row measures (a --model preset's layer shape), the config overrides that
make a MegaTrain row of it (the workload and the flags given, nothing else), and what stops the bench."""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

from bench.official.checkout import MissingCheckout
from bench.presets import MODELS
from bench.tokens import overrides as token_overrides
from megatrain.config.base import merge_overrides, parse_override
from megatrain.errors import ConfigError, DataError, MegatrainError
from megatrain.launch.control.failures import error_log

# Flag -> config key. A flag left out keeps the product's default: the benchmark measures the config a
# user gets, and every override a number needs is on its command line (BENCHMARKS.md quotes it).
KNOBS = {
    "k": "engine.checkpoint_interval",
    "last": "engine.last_block_layers",
    "chunk": "engine.chunk_sequences",
    "lean": "engine.lean_layers",
    "slab_params": "ipc.slab_params",
    "loss_chunk": "engine.loss_chunk_tokens",
    "packers": "actors.num_packers",
    "packer_threads": "actors.packer_threads",
    "accumulators": "actors.num_accumulators",
    "adam_threads": "actors.adam_threads",
    "accumulator_threads": "actors.accumulator_threads",
}


USAGE_ERROR, RUNTIME_ERROR = 2, 1


class Failed(Exception):
    """What stops the bench: one line for the user and the exit status (USAGE_ERROR or RUNTIME_ERROR)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, exc: BaseException, what: str = "", log_dir: Path | None = None) -> Failed:
        """As megatrain-launch words it: the input's errors exit 2, a run's 1, anything else is an internal error;
        where the run had its output directory, error.log there gets the traceback (a failed actor's own)."""
        code = USAGE_ERROR if isinstance(exc, (ConfigError, DataError, MissingCheckout)) else RUNTIME_ERROR
        message = (
            str(exc)
            if isinstance(exc, (MegatrainError, MissingCheckout))
            else f"internal error: {type(exc).__name__}: {exc}"
        )
        if log_dir is not None and log_dir.is_dir():
            (log_dir / "error.log").write_text(error_log(message, exc, traceback.format_exc()))
            message += f" (details in {log_dir / 'error.log'})"
        return cls(f"{what}: {message}" if what else message, code)


def bench_model(model: str, layers: int, extra: list[str]) -> tuple[dict, list[str]]:
    """The model every row measures (MegaTrain's variants and the peers alike): the --model preset's layer
    shape with `layers` layers and the model.hf.KEY=VALUE items of --extra applied; and the rest of --extra
    (overrides of the default variant only)."""
    shape = MODELS[model][1]
    mine = [item for item in extra if parse_override(item)[0][:2] == ["model", "hf"]]
    for item in mine:
        keys = parse_override(item)[0]
        if len(keys) < 3:
            raise ConfigError(
                f"--extra {item}: the bench's model is --model's layer shape; change it key by "
                "key with model.hf.KEY=VALUE"
            )
        if keys[2] == "num_hidden_layers":
            raise ConfigError(f"--extra {item}: the layer count is --layers")
    hf = merge_overrides({"model": {"hf": {**shape, "num_hidden_layers": layers}}}, mine)["model"]["hf"]
    return hf, [item for item in extra if item not in mine]


def overrides(args: argparse.Namespace, out: Path, extra: list[str], gpus: int | None = None) -> list[str]:
    """The workload (model shape, batch, steps, a constant LR so every step does the same work, no closing
    evaluation: it measures nothing here and cost each row half a minute) and the flags given; nothing else.
    args.hf is the model (bench_model())."""
    hf, gpus = args.hf, gpus or args.gpus
    knobs = [f"{key}={getattr(args, flag)}" for flag, key in KNOBS.items() if getattr(args, flag) is not None]
    return [
        f"model.family={MODELS[args.model][0]}",
        f"model.hf={json.dumps(hf)}",
        *([f"model.pretrained={args.init}"] if getattr(args, "init", None) else []),
        f"data.seq_len={args.seq}",
        f"data.batch_size={args.batch * gpus}",
        *(token_overrides(args.data) if getattr(args, "data", None) is not None else []),
        f"actors.num_gpus={gpus}",
        f"train.steps={args.steps}",
        f"train.timeline_step={args.steps}",
        f"train.output_dir={out}",
        "train.log_every=1",
        "engine.device=cuda",
        "optim.lr=1e-5",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "train.final_eval=false",
        *([f"engine.gpu_memory_gib={args.gpu_gib}"] if args.gpu_gib is not None else []),
        *knobs,
        *extra,
    ]
