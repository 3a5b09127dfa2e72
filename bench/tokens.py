"""--tokens: what the bench trains on. arithmetic: megatrain's generated problems ("37+45=82", byte tokens),
the dense presets' default; random: token ids drawn uniformly over the model's vocabulary, seeded, the
default for a mixture of experts.

A batch of the arithmetic data holds about 15 distinct token ids: a router cannot spread 15 kinds of token
evenly over 64 or 128 experts, and a user's text spreads over its vocabulary. The random tokens are one flat
token file under OUT; MegaTrain reads it through its own data path (data.kind tokens, windows in file order)
and every peer through the same code (batches()), so all of them train on the same batches: batch t of B
sequences is windows t·B to (t+1)·B, so DeepSpeed's rank r at world size g, reading batch t·g + r of B, gets
its share of MegaTrain's batch t of g·B. Loss values differ from the arithmetic data's; the step's work does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from megatrain.data import DataConfig, batch, open_data

TOKENS = ("arithmetic", "random")
SEED = 0


def default_tokens(hf: dict) -> str:
    """random for a model with experts (its routing is what the arithmetic data would distort), else arithmetic:
    the dense rows keep the data their numbers were measured on."""
    return "random" if any(k in hf for k in ("num_experts", "num_local_experts")) else "arithmetic"


def random_tokens(vocab: int, data: DataConfig, steps: int, out: Path, seed: int = SEED) -> DataConfig:
    """Write `steps` batches of `data`'s shape of token ids uniform over [0, vocab) (seeded) to
    out/tokens-random.bin; the DataConfig that reads them, batch t being the file's windows in order."""
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    ids = np.random.default_rng(seed).integers(0, vocab, size=steps * data.batch_size * data.seq_len, dtype=dtype)
    path = Path(out).resolve() / "tokens-random.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    ids.tofile(path)
    return dataclasses.replace(data, kind="tokens", path=str(path), token_dtype=dtype, shuffle=False)


def overrides(data: DataConfig) -> list[str]:
    """MegaTrain's config overrides that read `data`'s tokens (none for the arithmetic data, its default)."""
    if data.kind == "arithmetic":
        return []
    return [
        f"data.kind={data.kind}",
        f"data.path={data.path}",
        f"data.token_dtype={data.token_dtype}",
        "data.shuffle=false",
    ]


def batches(data: DataConfig, hf) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Batch t of `data` as (ids, labels), through MegaTrain's data path (megatrain.data.open_data): the peers
    and the routers' calibration read what MegaTrain trains on."""
    if data.kind == "arithmetic":
        return lambda t: batch(data, t)
    source = open_data(data, hf, None)

    def get(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = source.batch(t)
        return b.ids, b.labels

    return get
