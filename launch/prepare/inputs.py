"""The run's inputs: the checks of the model's config (transformers' import takes seconds), the data
(tokenized), the checkpoint a resume starts from (every checksum) and the model's structure. With Ray they are
read on a thread of the launcher (a Background of launch/run/stopping.py) while Ray starts and the actors
spawn: the actors' own start (their imports) is the longest part of the start-up, so they start first, and an
input refused meanwhile ends them again before the output directory or any shared memory is touched. A run
that may resume, and the in-process runner, read them first (launch/run/driver.py).

What takes no time to check is checked before Ray starts (check_first): a missing file, an output directory
holding another run, a tokenizer larger than the model's vocabulary, a GPU budget with no GPU to spend it on.
Refused there, the user does not wait out a Ray start (tens of seconds on a busy machine) for the line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from megatrain.config.base import Where
from megatrain.data import Data, expand_paths, open_data
from megatrain.errors import ConfigError, DataError
from megatrain.launch.config.tree import Config, check_model, gpu_budget_without_gpu, validate_model
from megatrain.launch.prepare.outdir import check_free
from megatrain.launch.prepare.resume import Start, choose_start
from megatrain.model.spec import ModelSpec, build_spec, resolve_hf_config


@dataclass
class Inputs:
    data: Data
    steps: int  # the run's steps (data.epochs may set them)
    begin: Start
    model: ModelSpec | None  # None when the run is already complete (nothing is built)


def read_inputs(cfg: Config, where: Where | None, out: Path) -> Inputs:
    validate_model(cfg, where)
    data = open_data(cfg.data, resolve_hf_config(cfg.model)[1], cfg.model.pretrained)
    steps = data.steps(cfg.train.steps)
    begin = choose_start(cfg, out, steps)
    return Inputs(data, steps, begin, None if begin.complete else build_spec(cfg.model, cfg.optim.no_decay_1d))


def check_first(cfg: Config, where: Where | None, out: Path, fresh: bool) -> None:
    """The checks of read_inputs that take no time, before Ray starts (read_inputs makes them all again).
    `fresh`: the run starts afresh in `out` (no checkpoint may resume it there), which must hold no other run."""
    if fresh:
        check_free(out, cfg.train.overwrite)
    arch = check_model(cfg, where)  # no torch or transformers: the shape fields, the sections
    problem = gpu_budget_without_gpu(cfg, remote=bool(cfg.launch.address or os.environ.get("RAY_ADDRESS")))
    if problem:
        raise ConfigError(problem)
    if cfg.data.kind == "arithmetic":
        return
    for key in ("path", "eval_path"):
        expand_paths(getattr(cfg.data, key), f"data.{key}")
    if cfg.data.kind == "tokens":
        return
    tok_dir, key = (
        (cfg.data.tokenizer, "data.tokenizer") if cfg.data.tokenizer else (cfg.model.pretrained, "model.pretrained")
    )
    if not tok_dir:
        return  # open_data says what is missing
    if not Path(tok_dir).is_dir():
        raise DataError(f"{key}: tokenizer directory '{tok_dir}' does not exist")
    size = _tokenizer_size(Path(tok_dir))
    if size is not None and size > arch.vocab_size:
        raise DataError(
            f"{key}: the tokenizer in '{tok_dir}' has {size} tokens, more than the model's vocab_size {arch.vocab_size}"
        )


def _tokenizer_size(directory: Path) -> int | None:
    """The tokens of a fast tokenizer's tokenizer.json, added ones included (what len() of transformers' own
    says), read without transformers; None where there is none, or it does not load (open_data says why)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - any refusal of the file is open_data's to report, with transformers' words
        return None
