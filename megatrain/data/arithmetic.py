"""The bundled dataset: generated arithmetic with exact answers, byte-level tokens. Nothing downloaded.

Batches are a pure function of (seed, step), so any step's batch can be rebuilt (resume, reference runs).
About a tenth of the possible problems (a fixed hash of a, op, b) never appear in training: evaluation
draws only from them, so its loss and exact-match accuracy are measured on problems the model never saw.
"""

from __future__ import annotations

import random
import zlib

import torch

from megatrain.config.data import BYTE_VOCAB_SIZE, DataConfig
from megatrain.layers.labels import IGNORE

END_ID = ord("\n")  # ends every answer: greedy evaluation stops there, and an exported model's eos
_EVAL_STREAM = 7_777_777  # separates the evaluation batches' seeds from the training steps'


class ByteTokenizer:
    """UTF-8 bytes are the tokens (vocab 256); models may have larger vocabularies."""

    vocab_size = BYTE_VOCAB_SIZE

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


def _space(cfg: DataConfig) -> int:
    return (cfg.max_operand + 1) ** 2 * len(cfg.ops)


def held_out(a: int, op: str, b: int) -> bool:
    """About one problem in ten of every operator is kept for evaluation: a CRC of the problem's text (a
    simple multiplicative hash of the operands left whole operators out)."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0


def _problem(rng: random.Random, cfg: DataConfig, evaluation: bool) -> tuple[str, str]:
    split = _space(cfg) >= 100  # a tiny problem space is not split: every problem is seen in training
    while True:
        a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
        op = rng.choice(cfg.ops)
        if not split or held_out(a, op, b) == evaluation:
            break
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", f"{answer}\n"


def _sequence(rng: random.Random, cfg: DataConfig, evaluation: bool) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < cfg.seq_len:
        q, a = _problem(rng, cfg, evaluation)
        qi, ai = ByteTokenizer.encode(q), ByteTokenizer.encode(a)
        ids += qi + ai
        # The label at position p is the token at p (the engine and HF shift by one), so an answer
        # token is learned from the position before it.
        labels += ([IGNORE] * len(qi) if cfg.loss_on == "answers" else qi) + ai
    return ids[: cfg.seq_len], labels[: cfg.seq_len]


def _batch(cfg: DataConfig, seed: int, evaluation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    rows = [_sequence(rng, cfg, evaluation) for _ in range(cfg.batch_size)]
    return (torch.tensor([r[0] for r in rows], dtype=torch.long), torch.tensor([r[1] for r in rows], dtype=torch.long))


def batch(cfg: DataConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training batch `step`: input ids and labels, both [batch_size, seq_len] int64."""
    return _batch(cfg, cfg.seed * 1_000_003 + step, False)


def eval_batch(cfg: DataConfig, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation batch `i`: held-out problems only, the same every evaluation."""
    return _batch(cfg, (cfg.seed + _EVAL_STREAM) * 1_000_003 + i, True)


def eval_problems(cfg: DataConfig) -> list[tuple[str, str]]:
    """The held-out problems answered by greedy generation: (question 'a+b=', answer 'c')."""
    rng = random.Random(cfg.seed + 2 * _EVAL_STREAM)
    return [(q, a.rstrip("\n")) for q, a in (_problem(rng, cfg, True) for _ in range(cfg.eval_problems))]


def answer_tokens(cfg: DataConfig) -> int:
    """Longest answer in tokens, its newline included: how many tokens greedy decoding generates."""
    m = cfg.max_operand
    extremes = {"+": 2 * m, "-": -m, "*": m * m}
    return max(len(str(extremes[op])) for op in cfg.ops) + 1


def prompts(cfg: DataConfig, problems: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The questions as right-padded rows for greedy decoding: (ids, position of each question's last
    token, tokens to generate). With causal attention the padding after a row's last token cannot change
    its prediction, so all rows decode together."""
    enc = [ByteTokenizer.encode(q) for q, _ in problems]
    steps = answer_tokens(cfg)
    ids = torch.full((len(enc), max(len(p) for p in enc) + steps), ord("\n"), dtype=torch.long)
    for r, p in enumerate(enc):
        ids[r, : len(p)] = torch.tensor(p)
    return ids, torch.tensor([len(p) - 1 for p in enc], dtype=torch.long), steps


def answers(generated: torch.Tensor) -> list[str]:
    """Each row's generated text up to its first newline."""
    return [ByteTokenizer.decode(row).split("\n")[0] for row in generated.tolist()]


def accuracy(problems: list[tuple[str, str]], got: list[str]) -> float:
    return sum(g == a for (_, a), g in zip(problems, got)) / max(len(problems), 1)
