"""Local data for the data tests: a BPE tokenizer trained here (no hub) and JSONL files of every kind."""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatrain.data import DataConfig
from megatrain.data.bpe import train_bpe
from tests.harness import TINY

WORDS = (
    "the",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "a",
    "mat",
    "big",
    "small",
    "red",
    "blue",
    "green",
    "house",
    "tree",
    "river",
    "stone",
    "light",
    "dark",
    "quick",
    "slow",
    "over",
    "under",
    "jumps",
    "walks",
    "sings",
    "reads",
    "writes",
    "bright",
    "quiet",
    "happy",
    "one",
    "two",
    "three",
    "four",
    "five",
)
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Knows system/user/assistant; any other role is refused by the template itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Renders only user and assistant turns and drops anything else without a word.
SILENT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # the test models' vocabulary: room for the tokenizer's 300


def sentence(rng: random.Random, n: int | None = None) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(3, 12)))


def make_tokenizer(directory: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE of TOKENIZER_VOCAB tokens with EOS, pad and the chat markers as special tokens."""
    rng = random.Random(0)
    train_bpe([sentence(rng) for _ in range(2000)], TOKENIZER_VOCAB, SPECIALS, template, pad="<|pad|>").save_pretrained(
        directory
    )
    return directory


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text_records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))} for _ in range(n)]


def chat_records(n: int, seed: int = 2) -> list[dict]:
    """Conversations of one to three exchanges, some with a system message."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 4)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
        out.append({"messages": msgs})
    return out


def prompt_completion_records(n: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": sentence(rng) + " ?", "completion": " " + sentence(rng)} for _ in range(n)]


def data_config(tmp_path: Path, tok_dir: Path, **kw) -> DataConfig:
    """The data path's config over the tokenizer in tok_dir: short windows, no shuffle, one worker."""
    base = dict(
        tokenizer=str(tok_dir),
        cache_dir=str(tmp_path / "cache"),
        seq_len=16,
        batch_size=2,
        shuffle=False,
        num_workers=1,
    )
    return DataConfig(**{**base, **kw})


def data_overrides(
    family: str, tmp_path: Path, tok_dir: Path, data: list[str], runner: str = "inprocess", steps: int = 10
) -> list[str]:
    """A tiny model of the family trained on the user's data (`data`: the data.* overrides)."""
    hf = {**TINY, "vocab_size": MODEL_VOCAB, "tie_word_embeddings": family == "qwen2"}
    if family == "mistral":
        hf["sliding_window"] = None
    return [
        f"model.family={family}",
        f"model.hf={json.dumps(hf)}",
        "data.seq_len=32",
        "data.batch_size=4",
        f"data.tokenizer={tok_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_workers=1",
        "optim.lr=2e-3",
        "optim.weight_decay=0.1",
        "optim.warmup_steps=2",
        "engine.checkpoint_interval=2",
        "engine.loss_chunk_tokens=40",
        f"train.steps={steps}",
        f"train.output_dir={tmp_path}/out",
        f"launch.runner={runner}",
        *data,
    ]
