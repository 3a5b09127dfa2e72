"""The run's inputs: the checks of the model's config (transformers' import takes seconds), the data
(tokenized), the checkpoint a resume starts from (every checksum) and the model's structure. With Ray they are
read on a thread of the launcher (a Background of launch/run/stopping.py) while Ray starts and the actors
spawn: the actors' own start (their imports) is the longest part of the start-up, so they start first, and an
input refused meanwhile ends them again before the output directory or any shared memory is touched. A run
that may resume, and the in-process runner, read them first (launch/run/driver.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatrain.configbase import Where
from megatrain.data import Data, open_data
from megatrain.launch.config.tree import Config, validate_model
from megatrain.launch.run.resume import Start, choose_start
from megatrain.model import ModelSpec, build_spec, resolve_hf_config


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
