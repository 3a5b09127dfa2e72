"""The data section of the config tree (owned by megatrain/data/). Outside that package, whose __init__
imports torch, so the config tree and its checks load without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.config.base import opt

KINDS = ("arithmetic", "text", "chat", "prompt_completion", "tokens")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
BYTE_VOCAB_SIZE = 256  # the arithmetic data's tokens are UTF-8 bytes (megatrain/data/arithmetic.py)


@dataclass
class DataConfig:
    kind: str = opt(
        "arithmetic",
        "Dataset: 'arithmetic' (generated problems like '37+45=82', byte tokens), "
        "'text' (JSONL, continued pre-training, packed), 'chat' (JSONL messages, loss on "
        "assistant turns), 'prompt_completion' (JSONL, loss on the completion) or "
        "'tokens' (a pretokenized flat .npy/.bin token file, packed).",
    )
    path: Any = opt(
        None,
        "Training data: one file, a glob, or a list of them (relative paths from the working "
        "directory); a directory written by datasets.save_to_disk for text/chat/"
        "prompt_completion. Unused for arithmetic.",
    )
    tokenizer: str | None = opt(
        None, "Local tokenizer directory (AutoTokenizer); default: model.pretrained. Never a hub name."
    )
    text_field: str = opt("text", "JSONL field holding a document (kind text).")
    messages_field: str = opt("messages", "JSONL field holding the list of {role, content} (kind chat).")
    prompt_field: str = opt("prompt", "JSONL field of the prompt (kind prompt_completion).")
    completion_field: str = opt("completion", "JSONL field of the completion (kind prompt_completion).")
    token_dtype: str = opt(
        "uint16",
        "Element type of a raw .bin token file (kind tokens): uint16, uint32, int32 "
        "or int64 (.npy files carry their own).",
    )
    packing: bool = opt(
        False,
        "chat/prompt_completion: concatenate the examples into one stream cut into windows "
        "of seq_len (like text) instead of one right-padded example per row.",
    )
    pack_documents: bool = opt(
        False,
        "Packed data (text, tokens, chat/prompt_completion with packing): keep the documents in a window "
        "apart: position ids restart at each document and attention does not cross documents (one "
        "attention call per document per layer), and no document's last token predicts the next one's "
        "first. A document is a JSONL record, or in a token file the tokens up to and including an EOS "
        "(the tokenizer's, else model.hf.eos_token_id).",
    )
    seq_len: int = opt(128, "Tokens per sequence.")
    batch_size: int = opt(8, "Sequences per optimizer step.")
    seed: int = opt(0, "Seed of the data order; batch t depends only on (data files, seed, t).")
    shuffle: bool = opt(True, "A seeded permutation of the windows/examples per epoch; false: file order.")
    epochs: int = opt(
        0,
        "Train for this many passes over the data (overrides train.steps); 0: train.steps "
        "steps, starting a new epoch whenever the data runs out.",
    )
    eval_path: Any = opt(None, "Evaluation data (same kind and rules as path); none: see eval_fraction.")
    eval_fraction: float = opt(
        0.0,
        "Without eval_path: hold out this fraction of the training windows/examples "
        "(the last ones in file order) for evaluation.",
    )
    eval_problems: int = opt(
        100,
        "Arithmetic: held-out problems whose answers are generated greedily at each evaluation (exact-match accuracy).",
    )
    cache_dir: str = opt(
        "",
        "Token cache (one tokenized copy per data file, tokenizer and format); empty: "
        "$MEGATRAIN_CACHE, else ~/.cache/megatrain/tokens.",
    )
    num_workers: int = opt(
        0,
        "Tokenizer processes for building the cache; 0: for chat and prompt_completion "
        "files of 32 MB and more one per usable CPU core (smaller ones in the driver), "
        "for text none (the Rust tokenizer's own threads, in the driver: faster).",
    )
    prefetch: int = opt(2, "Batches prepared ahead of the step in a background thread.")
    max_operand: int = opt(99, "Arithmetic: largest operand of a generated problem.")
    ops: str = opt("+-*", "Arithmetic: operators to draw from.")
    loss_on: str = opt("all", "Arithmetic: 'all' tokens carry a label, or only the 'answers' (after '=').")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"data.kind '{self.kind}' is not one of {', '.join(KINDS)}")
        if self.seq_len < 2:
            raise ValueError("data.seq_len must be >= 2 (a token and the next one it predicts)")
        if self.batch_size < 1:
            raise ValueError("data.batch_size must be >= 1")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"data.ops '{self.ops}' may only contain + - *")
        if self.loss_on not in ("all", "answers"):
            raise ValueError(f"data.loss_on must be 'all' or 'answers', not '{self.loss_on}'")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.token_dtype must be one of {', '.join(TOKEN_DTYPES)}, not '{self.token_dtype}'")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must be in [0, 1), not {self.eval_fraction}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, not {self.seed}")
        for key in ("epochs", "num_workers", "prefetch", "eval_problems"):
            if getattr(self, key) < 0:
                raise ValueError(f"data.{key} must be >= 0")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            ok = (
                value is None
                or isinstance(value, str)
                or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))
            )
            if not ok:
                raise ValueError(f"data.{key} must be a path, a glob or a list of them, not {value!r}")
        if self.pack_documents and (self.kind == "arithmetic" or self.padded):
            what = "the generated arithmetic" if self.kind == "arithmetic" else f"padded {self.kind} examples"
            raise ValueError(
                f"data.pack_documents needs packed data (data.kind text or tokens, or chat/prompt_completion "
                f"with data.packing: true), not {what}"
            )
        if self.kind != "arithmetic" and not self.path:
            raise ValueError(f"data.kind '{self.kind}' needs data.path (the data file(s))")

    @property
    def padded(self) -> bool:
        """One right-padded example per row (chat / prompt_completion without packing)."""
        return self.kind in ("chat", "prompt_completion") and not self.packing


def paths_of(value: Any) -> list[str]:
    """The paths of data.path / data.eval_path; None and "" (an empty override) are none."""
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)
