"""Data-path benchmark: tokenization throughput, and synthetic chat data for the step-time comparison.

  python bench/data.py --out OUT --text-mb 500

writes OUT/tok/ (a byte-level BPE tokenizer trained here, with a ChatML template), OUT/chat.jsonl
(multi-turn conversations) and OUT/text.jsonl (about --text-mb MB of documents), then tokenizes the
text as configured by default (data.num_workers 0: in the driver, the Rust tokenizer's threads) and
with one process per core, and the chat file by default (one process per core), each into a fresh
cache, and writes OUT/tokenize.json (records, tokens, seconds, tokens/s, MB/s).
The step-time comparison then runs bench/run.py twice, once with `--extra data.kind=chat
data.path=OUT/chat.jsonl data.tokenizer=OUT/tok` (BENCHMARKS.md has the commands).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatrain.data import DataConfig, open_data  # noqa: E402
from megatrain.data.bpe import train_bpe  # noqa: E402

SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ra",
    "te",
    "su",
    "no",
    "pa",
    "vi",
    "re",
    "to",
    "ma",
    "ne",
    "si",
    "lu",
    "da",
    "ko",
    "be",
    "ri",
    "fa",
    "go",
    "hu",
    "ze",
    "wa",
    "ye",
    "qu",
    "ix",
    "ol",
    "an",
    "er",
)


def vocabulary(rng: random.Random, n: int = 20000) -> list[str]:
    """Pseudo-words of 1-4 syllables with a Zipf-like use: a realistic spread for BPE merges."""
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def sentence(rng: random.Random, words: list[str], n: int) -> str:
    idx = (min(int(rng.paretovariate(1.1)) - 1, len(words) - 1) for _ in range(n))
    return " ".join(words[i] for i in idx).capitalize() + "."


def document(rng: random.Random, words: list[str]) -> str:
    return " ".join(sentence(rng, words, rng.randint(5, 25)) for _ in range(rng.randint(3, 40)))


def _text_part(job: tuple[Path, int, list[str], float]) -> Path:
    path, seed, words, mb = job
    rng, target = random.Random(seed), int(mb * 1e6)
    with open(path, "w") as f:
        while f.tell() < target:
            f.write(json.dumps({"text": document(rng, words)}) + "\n")
    return path


def write_text(path: Path, seed: int, words: list[str], mb: float) -> None:
    """About `mb` MB of documents, generated in parallel parts and joined."""
    import multiprocessing as mp
    import shutil

    n = os.cpu_count() or 1
    jobs = [(path.with_suffix(f".part{i}"), seed * 1000 + i, words, mb / n) for i in range(n)]
    with mp.get_context("fork").Pool(n) as pool, open(path, "wb") as out:
        for part in pool.imap(_text_part, jobs):
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
            part.unlink()


def write_chat(path: Path, rng: random.Random, words: list[str], n: int) -> None:
    with open(path, "w") as f:
        for _ in range(n):
            msgs = [{"role": "system", "content": sentence(rng, words, 8)}]
            for _ in range(rng.randint(1, 4)):
                msgs += [
                    {"role": "user", "content": sentence(rng, words, rng.randint(5, 40))},
                    {"role": "assistant", "content": document(rng, words)},
                ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def tokenize(path: Path, tok: Path, cache: Path, workers: int, kind: str = "text") -> dict:
    cfg = DataConfig(
        kind=kind,
        path=str(path),
        tokenizer=str(tok),
        cache_dir=str(cache),
        num_workers=workers,
        seq_len=4096,
        batch_size=1,
    )
    t0 = time.perf_counter()
    data = open_data(cfg, SimpleNamespace(vocab_size=1 << 20, pad_token_id=None), None)
    dt = time.perf_counter() - t0
    tokens = sum(int(f.ids.size) for f in data.train.files)
    mb = path.stat().st_size / 1e6
    return {
        "file": path.name,
        "kind": kind,
        "MB": round(mb, 1),
        "num_workers": workers,
        "records": sum(f.records for f in data.train.files),
        "tokens": tokens,
        "seconds": round(dt, 2),
        "tokens_per_s": round(tokens / dt),
        "MB_per_s": round(mb / dt, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--text-mb", type=float, default=500)
    p.add_argument("--chats", type=int, default=2000)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = vocabulary(rng)
    t0 = time.perf_counter()
    train_bpe((document(rng, words) for _ in range(20000)), args.vocab).save_pretrained(out / "tok")
    write_chat(out / "chat.jsonl", rng, words, args.chats)
    write_text(out / "text.jsonl", 1, words, args.text_mb)
    print(f"made the data in {time.perf_counter() - t0:.0f}s", flush=True)
    import transformers.models.auto.tokenization_auto  # noqa: F401 - its import (and torch's) is not tokenizing

    cores = os.cpu_count() or 1
    results = [
        tokenize(out / "text.jsonl", out / "tok", out / "cache-default", 0),  # the default: one process
        tokenize(out / "text.jsonl", out / "tok", out / "cache-pool", cores),  # one process per core
        tokenize(out / "chat.jsonl", out / "tok", out / "cache-chat", 0, "chat"),
    ]
    (out / "tokenize.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
