"""Training and evaluation data: the generated arithmetic, or the user's files through a tokenizer.

`open_data` does all the checking and tokenizing up front (in the driver, before any actor starts):
every problem with the data is a DataError naming the file and line. The result answers
`batch(t)` as a pure function of (data files, seed, t), so a resumed run sees the same batches.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain import log
from megatrain.config.data import DataConfig, paths_of
from megatrain.data import arithmetic
from megatrain.data.arithmetic import ByteTokenizer, batch
from megatrain.data.cache import Builder, TokenFile, stop_workers
from megatrain.data.datasets import Order, Packed, Padded, Source, Subset, stack
from megatrain.data.records import load_tokenizer
from megatrain.errors import DataError
from megatrain.layers.labels import IGNORE

__all__ = ["IGNORE", "ByteTokenizer", "DataConfig", "Data", "Batch", "batch", "open_data"]


@dataclass
class Batch:
    ids: torch.Tensor  # [batch_size, seq_len] int64
    labels: torch.Tensor  # same shape; IGNORE where no label
    epoch: float | None  # fractional epoch at the end of this batch (None for generated data)
    positions: torch.Tensor | None = None  # data.pack_documents: [batch_size, seq_len] int64 offsets in documents


class Data:
    """The run's data: training batches by step, evaluation batches, and what they are."""

    def __init__(self, cfg: DataConfig, train: Source | None, evaluation: Source | None, tokenizer: Any = None):
        self.cfg, self.train, self.eval, self.tokenizer = cfg, train, evaluation, tokenizer
        self.order = Order(len(train), cfg.batch_size, cfg.shuffle, cfg.seed) if train is not None else None
        self.problems = arithmetic.eval_problems(cfg) if cfg.kind == "arithmetic" else []

    # ---- training -----------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int | None:
        return self.order.per_epoch if self.order else None

    def steps(self, train_steps: int) -> int:
        """data.epochs > 0 wins over train.steps."""
        if self.cfg.epochs and self.order:
            return self.cfg.epochs * self.order.per_epoch
        return train_steps

    def batch(self, t: int) -> Batch:
        if self.order is None:
            ids, labels = batch(self.cfg, t)
            return Batch(ids, labels, None)
        _, index = self.order.batch(t)
        ids, labels, *positions = stack(self.train, index)
        return Batch(ids, labels, round((t + 1) / self.order.per_epoch, 4), positions[0] if positions else None)

    # ---- evaluation ---------------------------------------------------------------------------
    @property
    def has_eval(self) -> bool:
        return self.cfg.kind == "arithmetic" or self.eval is not None

    def eval_count(self, limit: int) -> int:
        """Evaluation batches per evaluation: the whole set (the last batch may be smaller), or the first
        `limit`; the generated arithmetic: `limit` or 8."""
        if self.eval is None:
            return (limit or 8) if self.has_eval else 0
        n = -(-len(self.eval) // self.cfg.batch_size)
        return min(limit, n) if limit else n

    def eval_batch(self, i: int) -> tuple[torch.Tensor, ...]:
        """Evaluation batch i, in file order (built when needed: the set may be large): (ids, labels), and
        the positions with data.pack_documents."""
        if self.eval is None:
            return arithmetic.eval_batch(self.cfg, i)
        B, n = self.cfg.batch_size, len(self.eval)
        return stack(self.eval, range(i * B, min((i + 1) * B, n)))

    def eval_batches(self, limit: int) -> list[tuple[torch.Tensor, ...]]:
        return [self.eval_batch(i) for i in range(self.eval_count(limit))]

    def describe(self) -> str:
        if self.order is None:
            return (
                f"data: generated arithmetic ({self.cfg.ops} up to {self.cfg.max_operand}), "
                f"{len(self.problems)} held-out problems for exact-match accuracy"
            )
        unit = "examples" if self.cfg.padded else f"windows of {self.cfg.seq_len} tokens"
        if self.cfg.pack_documents:
            unit += " (documents kept apart)"
        ev = f", {len(self.eval)} held out for evaluation" if self.eval is not None else ", no evaluation set"
        return (
            f"data: {self.cfg.kind}, {len(self.train)} {unit}{ev}; {self.order.per_epoch} batches of "
            f"{self.cfg.batch_size} per epoch, {'shuffled' if self.cfg.shuffle else 'in file order'}"
        )


def open_data(cfg: DataConfig, hf_config: Any, pretrained: str | None) -> Data:
    """Check, tokenize (cached) and index the data; DataError on anything wrong with it."""
    vocab = int(hf_config.vocab_size)
    if cfg.kind == "arithmetic":
        if vocab < ByteTokenizer.vocab_size:
            raise DataError(
                f"model.hf.vocab_size {vocab} is below the byte tokenizer's {ByteTokenizer.vocab_size}"
                " (data.kind arithmetic)"
            )
        return Data(cfg, None, None)
    tokenizer, eos = None, None
    if cfg.kind == "tokens":
        train_files = [_token_file(p, cfg, vocab) for p in expand_paths(cfg.path, "data.path")]
        eval_files = [_token_file(p, cfg, vocab) for p in expand_paths(cfg.eval_path, "data.eval_path")]
        eos = _eos_ids(cfg, hf_config, pretrained) if cfg.pack_documents else None
    else:
        tok_dir, key = (cfg.tokenizer, "data.tokenizer") if cfg.tokenizer else (pretrained, "model.pretrained")
        if not tok_dir:
            raise DataError(
                f"data.kind {cfg.kind} needs a tokenizer: set data.tokenizer (a local tokenizer "
                "directory) or model.pretrained"
            )
        tokenizer = load_tokenizer(tok_dir, key)
        if len(tokenizer) > vocab:
            raise DataError(
                f"{key}: the tokenizer in '{tok_dir}' has {len(tokenizer)} tokens, more than the model's "
                f"vocab_size {vocab}"
            )
        builder = Builder(cfg, tokenizer, tok_dir, key)
        try:
            train_files = [builder.get(p, "data.path") for p in expand_paths(cfg.path, "data.path")]
            eval_files = [builder.get(p, "data.eval_path") for p in expand_paths(cfg.eval_path, "data.eval_path")]
        finally:
            stop_workers()
    train, evaluation = _sources(cfg, train_files, eval_files, _pad_id(hf_config, tokenizer), eos)
    _check_enough(cfg, train)
    if evaluation is not None and len(evaluation) == 0:
        raise DataError(
            f"data.eval_path: the evaluation data holds no {'example' if cfg.padded else 'window'} "
            f"(a window is data.seq_len {cfg.seq_len} tokens)"
        )
    if isinstance(train, Padded) or (isinstance(train, Subset) and isinstance(train.source, Padded)):
        _report_truncation(train.source if isinstance(train, Subset) else train, cfg.seq_len)
    data = Data(cfg, train, evaluation, tokenizer)
    log(data.describe())
    return data


def expand_paths(value: Any, key: str) -> list[str]:
    """Files of a path, a glob, or a list of them, in the order given (a glob's matches sorted)."""
    out: list[str] = []
    for p in paths_of(value):
        if glob.has_magic(p):
            found = sorted(glob.glob(p))
            if not found:
                raise DataError(f"{key}: no file matches '{p}'")
            out += found
        elif not Path(p).exists():
            raise DataError(f"{key}: file '{p}' does not exist")
        else:
            out.append(p)
    return out


def _token_file(path: str, cfg: DataConfig, vocab: int) -> TokenFile:
    """A pretokenized flat token file, memory-mapped; every id checked against the vocabulary."""
    if not path.endswith(".npy"):
        _check_whole_tokens(path, cfg.token_dtype)
    try:
        if path.endswith(".npy"):
            ids = np.load(path, mmap_mode="r")
        else:
            ids = np.memmap(path, dtype=cfg.token_dtype, mode="r")
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a token file: {exc}") from None
    if ids.dtype.name not in ("uint16", "uint32", "int32", "int64"):
        raise DataError(f"{path}: tokens of type {ids.dtype.name}; expected uint16, uint32, int32 or int64")
    ids = ids.reshape(-1)
    if ids.size == 0:
        raise DataError(f"{path}: no tokens (the file is empty)")
    step = 1 << 26
    for lo in range(0, ids.size, step):
        part = np.asarray(ids[lo : lo + step])
        bad = np.nonzero((part >= vocab) | (part < 0))[0]
        if bad.size:
            i = lo + int(bad[0])
            raise DataError(
                f"{path}: token id {int(ids[i])} at index {i} is outside the model's vocabulary (vocab_size {vocab})"
            )
    return TokenFile(path, ids, None, None)


def _check_whole_tokens(path: str, dtype: str) -> None:
    """A raw token file holds whole tokens of data.token_dtype: its size is a multiple of the token's."""
    size, width = Path(path).stat().st_size, np.dtype(dtype).itemsize
    if size % width:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of data.token_dtype {dtype} tokens ({width} "
            f"bytes each): {size // width} tokens and {size % width} byte(s) left over; is "
            f"data.token_dtype the dtype the file was written with?"
        )


def _pad_id(hf_config: Any, tokenizer: Any) -> int:
    """Padding input: the model's pad token, else the tokenizer's, else EOS (its label is IGNORE anyway)."""
    for pid in (
        getattr(hf_config, "pad_token_id", None),
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if pid is not None:
            return int(pid)
    return 0


def _eos_ids(cfg: DataConfig, hf_config: Any, pretrained: str | None) -> list[int]:
    """The ids that end a document in a token file (data.pack_documents): the tokenizer's EOS
    (data.tokenizer, else model.pretrained's if it holds one), else the model's eos_token_id (an id or a
    list of them)."""
    eos = None
    if cfg.tokenizer:
        eos = load_tokenizer(cfg.tokenizer, "data.tokenizer").eos_token_id
    elif pretrained:
        try:
            eos = load_tokenizer(pretrained, "model.pretrained").eos_token_id
        except DataError:  # a checkpoint without tokenizer files: its config may still name EOS
            eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    if not ids:
        raise DataError(
            "data.pack_documents: data.kind tokens needs the EOS id that ends each document: set "
            "data.tokenizer (a tokenizer with an eos_token) or model.hf.eos_token_id"
        )
    return ids


def _sources(
    cfg: DataConfig, train_files: list[TokenFile], eval_files: list[TokenFile], pad_id: int, eos: list[int] | None
) -> tuple[Source, Source | None]:
    def make(files: list[TokenFile]) -> Packed | Padded:
        if cfg.padded:
            return Padded(files, cfg.seq_len, pad_id)
        return Packed(files, cfg.seq_len, cfg.pack_documents, eos)

    train = make(train_files)
    if eval_files:
        return train, make(eval_files)
    if cfg.eval_fraction > 0:
        n = len(train)
        held = max(1, round(n * cfg.eval_fraction))
        return Subset(train, 0, n - held), Subset(train, n - held, n)
    return train, None


def _check_enough(cfg: DataConfig, train: Source) -> None:
    if len(train) >= cfg.batch_size:
        return
    what = "examples" if cfg.padded else f"windows of data.seq_len {cfg.seq_len} tokens"
    held = " after the held-out part (data.eval_fraction)" if isinstance(train, Subset) else ""
    raise DataError(
        f"data.path: the data holds {len(train)} {what}{held}; one batch needs data.batch_size {cfg.batch_size}"
    )


def _report_truncation(source: Padded, seq_len: int) -> None:
    cut, lost = source.truncation()
    if cut:
        log(
            f"data: {cut} of {len(source)} examples are longer than seq_len {seq_len} and were cut"
            + (f"; {lost} of them kept no label token (they add nothing to the loss)" if lost else "")
        )
