"""From records to tokens: reading JSONL lines and encoding one record of each kind into (ids, mask).

mask[i] = 1 where token i carries a label (it is predicted from the tokens before it):
  text               every token; documents end with EOS
  chat               the tokens of every assistant turn, as rendered by the tokenizer's chat template
                     (its end-of-turn marker included), none of system/user/tool tokens
  prompt_completion  the completion's tokens and the EOS after it
Every problem with a record raises RecordError, which the caller turns into 'file:line: message'.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from megatrain.config.data import DataConfig
from megatrain.errors import DataError


class RecordError(ValueError):
    """What is wrong with one record (the caller adds file and line)."""


def parse_line(raw: bytes) -> dict | None:
    """One JSONL line as a JSON object; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"not valid UTF-8 (byte {exc.start})") from None
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError(f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(rec, dict):
        raise RecordError(f"expected a JSON object, got {type(rec).__name__}")
    return rec


def _field(rec: dict, key: str, cfg_key: str) -> str:
    if key not in rec:
        raise RecordError(f"missing field '{key}' (set by data.{cfg_key}); the record has {sorted(rec)[:8]}")
    value = rec[key]
    if not isinstance(value, str):
        raise RecordError(f"field '{key}' must be a string, got {type(value).__name__}")
    return value


def load_tokenizer(directory: str, key: str) -> Any:
    """AutoTokenizer from a local directory only; `key` is the config key that named it."""
    from pathlib import Path

    if not Path(directory).is_dir():
        raise DataError(f"{key}: tokenizer directory '{directory}' does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{key}: cannot load a tokenizer from '{directory}': {first}") from None


class Encoder:
    """Encodes records of one kind with one tokenizer; used in the tokenizer worker processes."""

    def __init__(self, cfg: DataConfig, tokenizer: Any):
        self.cfg, self.tok, self.kind = cfg, tokenizer, cfg.kind
        self.eos = tokenizer.eos_token_id
        if self.kind in ("text", "prompt_completion") and self.eos is None:
            raise DataError(f"data.kind {self.kind}: the tokenizer has no eos_token, which ends every document")
        if self.kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.kind chat: the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)"
            )
        if self.kind == "chat" and not getattr(tokenizer, "is_fast", False):
            raise DataError("data.kind chat needs a fast tokenizer (tokenizer.json) to map turns to tokens")

    def encode_many(self, recs: list[tuple[int, dict]]) -> list[tuple[list[int], list[int] | None]]:
        """Encode (line index, record) pairs; RecordError(message, line index) for a bad one. Text is
        tokenized in one call for all of them."""
        if self.kind == "text":
            texts = [self._at(i, _field, r, self.cfg.text_field, "text_field") for i, r in recs]
            return [(self._with_eos(list(ids)), None) for ids in self.tok(texts)["input_ids"]] if texts else []
        return [self._at(i, self.encode, r) for i, r in recs]

    @staticmethod
    def _at(line: int, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RecordError as exc:
            raise RecordError(exc.args[0], line) from None

    def encode(self, rec: dict) -> tuple[list[int], list[int]]:
        """One chat or prompt/completion record (text goes through encode_many, batched)."""
        return self._prompt_completion(rec) if self.kind == "prompt_completion" else self._chat(rec)

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def _with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.eos else [*ids, self.eos]

    def _prompt_completion(self, rec: dict) -> tuple[list[int], list[int]]:
        prompt = self._ids(_field(rec, self.cfg.prompt_field, "prompt_field"), True)
        if prompt and prompt[-1] == self.eos:  # a tokenizer that appends EOS must not end the prompt with it
            prompt = prompt[:-1]
        completion = self._with_eos(self._ids(_field(rec, self.cfg.completion_field, "completion_field"), False))
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)

    # ---- chat ---------------------------------------------------------------------------------
    def _render(self, messages: list[dict], prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        except TemplateError as exc:
            raise RecordError(f"the chat template refused the conversation: {exc}") from None

    def _messages(self, rec: dict) -> list[dict]:
        key = self.cfg.messages_field
        msgs = rec.get(key)
        if not isinstance(msgs, list) or not msgs:
            raise RecordError(f"missing or empty field '{key}' (a list of {{role, content}}; data.messages_field)")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RecordError(f"message {i} must be an object with string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in msgs):
            raise RecordError("the conversation has no assistant turn (nothing to learn from)")
        return msgs

    def _chat(self, rec: dict) -> tuple[list[int], list[int]]:
        msgs = self._messages(rec)
        full = self._render(msgs)
        spans = self._assistant_spans(msgs, full, self._positions(msgs, full))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s < hi and e > lo for lo, hi in spans)) for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    @staticmethod
    def _positions(msgs: list[dict], full: str) -> list[int]:
        """Where each message's content starts in the rendering, searched in order. Every message must
        appear: some templates drop a role they do not know without a word (and some trim)."""
        out, cursor = [], 0
        for i, m in enumerate(msgs):
            text = m["content"].strip()
            at = full.find(text, cursor)
            if at < 0:
                raise RecordError(
                    f"message {i} (role '{m['role']}') does not appear in the chat template's "
                    "rendering: the template does not know this role (or rewrites the content)"
                )
            out.append(at)
            cursor = at + len(text)
        return out

    def _assistant_spans(self, msgs: list[dict], full: str, pos: list[int]) -> list[tuple[int, int]]:
        """Character spans of every assistant turn in `full`: the text its message adds to the conversation
        rendered up to the generation prompt before it, so the end-of-turn marker is included. A template
        that renders earlier turns differently from the last (e.g. one that strips earlier reasoning) gets
        the content at its own position plus the end-of-turn marker the template puts after a last turn."""
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._render(msgs[:i], prompt=True) if i else ""
            upto = self._render(msgs[: i + 1])
            if upto.startswith(before) and full.startswith(upto) and len(upto) > len(before):
                spans.append((len(before), len(upto)))
                continue
            text = m["content"].strip()
            lo = hi = pos[i]
            hi += len(text)
            cut = upto.rfind(text) if text else -1
            tail = upto[cut + len(text) :] if cut >= 0 else ""
            if tail and full.startswith(tail, hi):
                hi += len(tail)
            spans.append((lo, hi))
        return spans


def jsonl_records(path: str, start: int, end: int) -> Iterator[tuple[int, dict | None]]:
    """(line index within the byte range, record or None for a blank line) of lines starting in
    [start, end); RecordError carries the line index in its args[1]."""
    with open(path, "rb") as f:
        f.seek(start)
        pos, i = start, 0
        while pos < end:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            if pos == len(raw) and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows tools)
                raw = raw[3:]
            try:
                yield i, parse_line(raw)
            except RecordError as exc:
                raise RecordError(str(exc), i) from None
            i += 1


def split_ranges(path: str, size: int, chunk: int) -> list[tuple[int, int]]:
    """Byte ranges of about `chunk` bytes that start at line beginnings."""
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk < size:
            f.seek(bounds[-1] + chunk)
            f.readline()
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    return list(zip(bounds, [*bounds[1:], size]))
