"""The bundled dataset: generated arithmetic with exact answers, byte-level tokens. Nothing downloaded.

Batches are a pure function of (seed, step), so any step's batch can be rebuilt (resume, reference runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from megatrain.configbase import opt

IGNORE = -100


@dataclass
class DataConfig:
    kind: str = opt("arithmetic", "Dataset: 'arithmetic' (generated problems like '37+45=82', byte tokens).")
    seq_len: int = opt(128, "Tokens per sequence.")
    batch_size: int = opt(8, "Sequences per optimizer step.")
    seed: int = opt(0, "Seed of the data stream; batch t depends only on (seed, t).")
    max_operand: int = opt(99, "Largest operand of a generated problem.")
    ops: str = opt("+-*", "Operators to draw from.")
    loss_on: str = opt("all", "'all' tokens carry a label, or only the 'answers' (digits after '=').")

    def __post_init__(self) -> None:
        if self.kind != "arithmetic":
            raise ValueError(f"data.kind '{self.kind}' is not known; the bundled kind is 'arithmetic'")
        if self.seq_len < 2 or self.batch_size < 1:
            raise ValueError("data.seq_len must be >= 2 and data.batch_size >= 1")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"data.ops '{self.ops}' may only contain + - *")
        if self.loss_on not in ("all", "answers"):
            raise ValueError(f"data.loss_on must be 'all' or 'answers', not '{self.loss_on}'")


class ByteTokenizer:
    """UTF-8 bytes are the tokens (vocab 256); models may have larger vocabularies."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


def _problem(rng: random.Random, cfg: DataConfig) -> tuple[str, str]:
    a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
    op = rng.choice(cfg.ops)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", f"{answer}\n"


def _sequence(rng: random.Random, cfg: DataConfig) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < cfg.seq_len:
        q, a = _problem(rng, cfg)
        qi, ai = ByteTokenizer.encode(q), ByteTokenizer.encode(a)
        ids += qi + ai
        # The label at position p is the token at p (the engine and HF shift by one), so an answer
        # token is learned from the position before it.
        labels += ([IGNORE] * len(qi) if cfg.loss_on == "answers" else qi) + ai
    return ids[: cfg.seq_len], labels[: cfg.seq_len]


def batch(cfg: DataConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step`: input ids and labels, both [batch_size, seq_len] int64."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    rows = [_sequence(rng, cfg) for _ in range(cfg.batch_size)]
    ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
    labels = torch.tensor([r[1] for r in rows], dtype=torch.long)
    return ids, labels
