"""Document boundaries in packed windows (data.pack_documents): where each document starts, each token's
offset inside its document (the position ids), and the labels that would cross a boundary.

A window is cut from the joined token stream, so it may start in the middle of a document: its first
token is position 0 all the same (nothing before it is in the window to attend to). A document starts at
a record's first token for the JSONL kinds (the cache keeps the record boundaries, exactly the documents
the user wrote, whether or not the chat template ends them with EOS), and right after each EOS in a
token file (which has no record boundaries; the EOS belongs to the document it ends). Everything here is
vectorized numpy over one window.
"""

from __future__ import annotations

import numpy as np

from megatrain.layers.labels import IGNORE


def eos_starts(part: np.ndarray, eos: np.ndarray, before: int | None) -> np.ndarray:
    """True where a token of `part` starts a document: right after an EOS id. `before` is the token just
    before `part` in its file (None at the file's start, which starts a document)."""
    starts = np.empty(part.size, dtype=bool)
    if part.size == 0:
        return starts
    starts[0] = before is None or bool(np.isin(before, eos))
    starts[1:] = np.isin(part[:-1], eos)
    return starts


def record_starts(offsets: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """True where a token of a file's range [lo, hi) is a record's first token (offsets: the records'
    boundaries in the file, offsets[0] = 0)."""
    starts = np.zeros(hi - lo, dtype=bool)
    i0, i1 = np.searchsorted(offsets, [lo, hi], side="left")
    starts[np.asarray(offsets[i0:i1], dtype=np.int64) - lo] = True
    return starts


def positions(starts: np.ndarray) -> np.ndarray:
    """Each token's offset inside its document (int64): 0 at the window's first token and wherever
    `starts` is True, counting up to the next start."""
    idx = np.arange(starts.size, dtype=np.int64)
    first = np.where(starts, idx, 0)
    first[:1] = 0  # the window's first token starts a document whatever came before it
    return idx - np.maximum.accumulate(first)


def cut_labels(labels: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The labels with IGNORE at every document start after the window's first token: labels are aligned
    with the ids and position j-1 predicts labels[j], so no document's last token predicts the next one's
    first token (the model never sees across the boundary, so it could only guess)."""
    out = labels.copy()
    cut = pos == 0
    cut[:1] = False  # the window's first token is never a target anyway
    out[cut] = IGNORE
    return out
