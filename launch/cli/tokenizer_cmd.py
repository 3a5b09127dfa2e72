"""`megatrain-launch tokenizer DATA [DATA ...] --out DIR [--vocab-size N] [--text-key KEY]`: a tokenizer made
from the user's own text, on this machine (the `tokenizers` library; nothing downloaded).

A byte-level BPE (any UTF-8 text encodes, no unknown token) saved as a transformers tokenizer directory, which
`AutoTokenizer.from_pretrained(DIR)` loads and `data.tokenizer: DIR` takes. Its special tokens: <|endoftext|>
(id 0) ends every document (EOS) and is also BOS and padding, so an exported model's config and generation
config get ids that mean what they say; <|im_start|> and <|im_end|> with a ChatML chat template, so the same
directory serves data.kind chat.

DATA: the files a run reads, JSONL (.jsonl, .ndjson, .json: one record a line) with the text of every record
(KEY, default `text` as data.text_field; the contents of `messages`; `prompt` and `completion`), or plain
UTF-8 text (any other name). A glob names its matches.
"""

from __future__ import annotations

import argparse
import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the first is EOS, BOS and padding
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TOKEN_SUFFIXES = (".npy", ".bin")  # data.kind tokens: already token ids
BYTES = 256  # the byte-level alphabet every BPE vocabulary starts from
DEFAULT_VOCAB = 8192


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"tokenizer: {message} (usage: {USAGE})")


USAGE = "megatrain-launch tokenizer DATA [DATA ...] --out DIR [--vocab-size N] [--text-key KEY]"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="megatrain-launch tokenizer",
        usage=USAGE,
        description="Train a byte-level BPE tokenizer on your own text files, locally.",
    )
    p.add_argument("data", nargs="+", help="JSONL or plain text files, or globs (quote them)")
    p.add_argument("--out", required=True, help="the tokenizer directory to write (new or empty)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help=f"tokens in the vocabulary, special tokens included (default {DEFAULT_VOCAB}); the "
        "model's model.hf.vocab_size must be at least as large",
    )
    p.add_argument("--text-key", default="text", help="JSONL field holding a document (data.text_field; default text)")
    return p


def expand(patterns: list[str]) -> list[Path]:
    """The files named, a glob's matches in sorted order (as data.path reads them)."""
    files: list[Path] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise ConfigError(f"tokenizer: no file matches '{pattern}'")
        for name in found:
            path = Path(name)
            if not path.is_file():
                raise ConfigError(
                    f"tokenizer: '{path}' " + ("is a directory; name its files" if path.is_dir() else "does not exist")
                )
            if path.suffix in TOKEN_SUFFIXES:
                raise ConfigError(f"tokenizer: '{path}' holds token ids (data.kind tokens), not text")
            files.append(path)
    return files


def texts(files: list[Path], text_key: str) -> Iterator[str]:
    """Every text of the files, streamed (a file may be larger than memory)."""
    for path in files:
        yield from (_jsonl_texts(path, text_key) if path.suffix in JSONL_SUFFIXES else _plain_texts(path))


def _plain_texts(path: Path) -> Iterator[str]:
    """A plain text file, line by line."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"tokenizer: {path}:{i}: not valid UTF-8 (byte {exc.start} of the line)") from None


def _jsonl_texts(path: Path, text_key: str) -> Iterator[str]:
    from megatrain.data.records import RecordError, jsonl_records

    records, line = jsonl_records(str(path), 0, os.path.getsize(path)), 0
    while True:
        try:
            line, rec = next(records)
            found = _record_texts(rec, text_key) if rec is not None else []
        except StopIteration:
            return
        except RecordError as exc:  # the line's index: in the error where the reader raised it, else this one's
            at = exc.args[1] if len(exc.args) > 1 else line
            raise ConfigError(f"tokenizer: {path}:{at + 1}: {exc.args[0]}") from None
        yield from found


def _record_texts(rec: dict, text_key: str) -> list[str]:
    """The text of one record of any kind a run reads: a document, a conversation, a prompt and completion."""
    if isinstance(rec.get(text_key), str):
        return [rec[text_key]]
    if isinstance(rec.get("messages"), list):
        return [m["content"] for m in rec["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)]
    pair = [rec[k] for k in ("prompt", "completion") if isinstance(rec.get(k), str)]
    if pair:
        return pair
    from megatrain.data.records import RecordError

    raise RecordError(
        f"no text: no string field '{text_key}' (--text-key), 'messages' or 'prompt'/'completion'; "
        f"the record has {sorted(rec)[:8]}"
    )


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"tokenizer: --out '{out}' "
            + ("is not a directory" if not out.is_dir() else "is not empty; name a new directory")
        )


def train(files: list[Path], vocab_size: int, text_key: str) -> tuple[Any, int]:
    """The trained tokenizer (a transformers fast tokenizer; EOS, BOS and padding set) and the texts read."""
    from megatrain.data.bpe import CHATML, train_bpe

    count = 0

    def counted() -> Iterator[str]:
        nonlocal count
        for text in texts(files, text_key):
            count += 1
            yield text

    tok = train_bpe(counted(), vocab_size, SPECIALS, CHATML)
    if count == 0:
        raise ConfigError(f"tokenizer: no text in {', '.join(map(str, files))}")
    tok.bos_token = SPECIALS[0]  # a model's bos_token_id then names a real token (export copies it)
    return tok, count


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.vocab_size < BYTES + len(SPECIALS):
        raise ConfigError(
            f"tokenizer: --vocab-size {args.vocab_size} is below {BYTES + len(SPECIALS)} (the "
            f"{BYTES} byte tokens and {len(SPECIALS)} special tokens)"
        )
    out = Path(args.out)
    _check_out(out)
    files = expand(args.data)
    tok, count = train(files, args.vocab_size, args.text_key)
    try:
        tok.save_pretrained(out)
    except OSError as exc:
        raise ConfigError(f"tokenizer: cannot write '{out}': {exc.strerror or exc}") from None
    n = len(tok)
    fewer = "" if n == args.vocab_size else f" (not {args.vocab_size}: the text has no more pairs to merge)"
    print(
        f"megatrain-launch tokenizer: wrote {out}: a byte-level BPE of {n} tokens{fewer} from {count} texts "
        f"(records or lines) in {len(files)} file(s); "
        f"{SPECIALS[0]} (id {tok.eos_token_id}) ends documents and is BOS and padding, ChatML chat template. "
        f"Train with data.tokenizer={out} and model.hf.vocab_size >= {n}"
    )
    return 0
