"""The special-token ids (bos, eos, pad) an exported model's config.json and generation_config.json carry.

generate() stops at the config's eos id and starts from its bos id, so an id the data never held makes an
exported model that never stops, or one prompted with a token it never saw. A model config built fresh
keeps its class's defaults (Llama: bos 1, eos 2) whatever the data is; the ids written are therefore taken
from what the run actually trained on:

- a run with a tokenizer (data.tokenizer, else model.pretrained's where it holds one): the tokenizer's own
  ids, None where it defines no such token;
- byte data (data.kind arithmetic): the newline that ends every answer is the end token (greedy decoding
  stops there in evaluation, and so does generate()); no BOS, no padding;
- a token file without a tokenizer: the ids the run's config states (model.hf, or model.pretrained's
  config.json); None for the others.

An id set in model.hf is the user's word and is kept for byte data and token files; a tokenizer's ids win
over it, and every change from the model config is printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatrain.data.arithmetic import END_ID
from megatrain.data.records import load_tokenizer
from megatrain.errors import ConfigError

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def run_tokenizer(run: dict) -> str | None:
    """The tokenizer directory a run's data was tokenized with (run: the resolved config as plain data);
    None for byte data (arithmetic) and for a run without one."""
    data, model = run.get("data") or {}, run.get("model") or {}
    if data.get("kind", "arithmetic") == "arithmetic":
        return None  # byte tokens: a data.tokenizer set anyway is not what the run trained on
    if data.get("tokenizer"):
        return str(data["tokenizer"])
    pretrained = model.get("pretrained")
    if pretrained and any((Path(pretrained) / f).is_file() for f in TOKENIZER_MARKERS):
        return str(pretrained)
    return None


Ids = dict[str, tuple[Any, str]]  # key -> (the id or None, where it comes from, for the printed change)


def special_ids(run: dict, hf_config: Any, tokenizer: str | None) -> Ids:
    """bos/eos/pad ids for the exported config of the run `run` (the resolved config as plain data)."""
    if tokenizer:
        return _from_tokenizer(Path(tokenizer), hf_config)
    data, model = run.get("data") or {}, run.get("model") or {}
    stated = {k: (v, "model.hf") for k, v in (model.get("hf") or {}).items() if k in SPECIAL_IDS}
    if data.get("kind", "arithmetic") == "arithmetic":
        none = (None, "byte data has no such token")
        return {
            "bos_token_id": none,
            "eos_token_id": (END_ID, "byte data: a newline ends every answer"),
            "pad_token_id": none,
            **stated,
        }
    pretrained = _pretrained_ids(model.get("pretrained"), hf_config)
    return {
        key: stated.get(key) or pretrained.get(key) or (None, "not stated for this token data") for key in SPECIAL_IDS
    }


def _pretrained_ids(pretrained: str | None, hf_config: Any) -> Ids:
    """The special ids model.pretrained's config.json states; where it cannot be read any more (the
    directory moved since the run), the run's model config, which took them from it."""
    if not pretrained:
        return {}
    try:
        base = json.loads((Path(pretrained) / "config.json").read_text())
    except (OSError, ValueError):
        return {k: (getattr(hf_config, k, None), "the run's model config") for k in SPECIAL_IDS}
    return {k: (base[k], "model.pretrained's config.json") for k in SPECIAL_IDS if k in base}


def _from_tokenizer(tokenizer: Path, hf_config: Any) -> Ids:
    """The tokenizer's ids; None where it has no such token. An eos list in the model config (a
    pretrained model's several end tokens) is kept where it holds the tokenizer's eos."""
    tok = load_tokenizer(str(tokenizer), "the run's tokenizer")
    out: Ids = {}
    for key in SPECIAL_IDS:
        want, had = getattr(tok, key, None), getattr(hf_config, key, None)
        if want is None:
            out[key] = (None, f"the tokenizer has no {key.split('_')[0]} token")
        elif isinstance(had, list) and want in had:
            out[key] = (had, f"the tokenizer's {tok.convert_ids_to_tokens(want)!r} among them")
        else:
            out[key] = (want, f"the tokenizer's {tok.convert_ids_to_tokens(want)!r}")
    return out


def apply_ids(config: Any, ids: Ids) -> None:
    """Set the ids on the exported config, printing each change; an id outside the vocabulary is refused."""
    for key, (want, why) in ids.items():
        had = getattr(config, key, None)
        for one in want if isinstance(want, list) else [want]:
            if one is not None and not 0 <= int(one) < config.vocab_size:
                raise ConfigError(f"{key} {one} ({why}) is outside the model's vocabulary of {config.vocab_size}")
        if want != had:
            print(f"[megatrain] export: config {key} {had} -> {want} ({why})", flush=True)
            setattr(config, key, want)
