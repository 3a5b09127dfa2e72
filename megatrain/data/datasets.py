"""Windows, examples and the order they are consumed in.

Order contract (README "Train on your own data"):
  packed (text, tokens, chat/prompt_completion with packing): the files' token streams are joined in the
    order given; window w holds tokens [w*L, (w+1)*L) of that stream (a trailing part window is dropped).
  padded (chat, prompt_completion): example i is the i-th record, cut to L tokens and right-padded.
  Without shuffle, batch t of an epoch holds items [t*B, (t+1)*B); with shuffle, the items at positions
  [t*B, (t+1)*B) of a permutation seeded by (data.seed, epoch). An epoch is floor(items / B) batches
  (the last, incomplete batch's items are left out of that epoch). So batch t depends only on the data
  files, the seed and t.
With data.pack_documents a packed item is (ids, labels, positions): megatrain/data/documents.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import megatrain.data.documents as documents
from megatrain.data.cache import TokenFile
from megatrain.layers.labels import IGNORE

Item = tuple[np.ndarray, ...]  # (ids, labels), or (ids, labels, positions) with packed documents


def _labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The ids where the mask says the token carries a label, IGNORE elsewhere."""
    return np.where(np.asarray(mask) != 0, ids, IGNORE)


class Packed:
    """Windows of `seq_len` tokens over the files' joined token stream. With `documents` on, each window
    also gives its tokens' positions inside their documents, and no label crosses a document boundary;
    `eos` (the ids that end a document) marks the boundaries in files without records (token files)."""

    def __init__(self, files: list[TokenFile], seq_len: int, documents: bool = False, eos: list[int] | None = None):
        self.files, self.seq_len, self.documents = files, seq_len, documents
        self.eos = np.asarray(eos or [], dtype=np.int64)
        sizes = [int(f.ids.size) for f in files]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.tokens = int(self.starts[-1])

    def __len__(self) -> int:
        return self.tokens // self.seq_len

    def _span(self, lo: int, hi: int) -> Item:
        ids, labels, starts = [], [], []
        f = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            tf, base = self.files[f], int(self.starts[f])
            end = min(hi, int(self.starts[f + 1]))
            part = np.asarray(tf.ids[lo - base : end - base], dtype=np.int64)
            ids.append(part)
            labels.append(part if tf.mask is None else _labels(part, tf.mask[lo - base : end - base]))
            if self.documents:
                starts.append(self._starts(tf, part, lo - base, end - base))
            lo, f = end, f + 1
        out = (np.concatenate(ids), np.concatenate(labels))
        if not self.documents:
            return out
        pos = documents.positions(np.concatenate(starts))
        return out[0], documents.cut_labels(out[1], pos), pos

    def _starts(self, tf: TokenFile, part: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Document starts among a file's tokens [lo, hi) (`part`): its records' first tokens, or for a
        token file the tokens after an EOS (a file's first token starts a document either way)."""
        if tf.offsets is not None:
            return documents.record_starts(np.asarray(tf.offsets), lo, hi)
        return documents.eos_starts(part, self.eos, int(tf.ids[lo - 1]) if lo else None)

    def item(self, w: int) -> Item:
        return self._span(w * self.seq_len, (w + 1) * self.seq_len)


class Padded:
    """One record per row, cut to `seq_len` and right-padded with `pad_id` (labels IGNORE there)."""

    def __init__(self, files: list[TokenFile], seq_len: int, pad_id: int):
        self.files, self.seq_len, self.pad_id = files, seq_len, pad_id
        self.starts = np.concatenate([[0], np.cumsum([f.records for f in files])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def item(self, i: int) -> Item:
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        tf, r = self.files[f], i - int(self.starts[f])
        lo, hi = int(tf.offsets[r]), int(tf.offsets[r + 1])
        hi = min(hi, lo + self.seq_len)
        ids = np.full(self.seq_len, self.pad_id, np.int64)
        labels = np.full(self.seq_len, IGNORE, np.int64)
        ids[: hi - lo] = tf.ids[lo:hi]
        labels[: hi - lo] = _labels(ids[: hi - lo], tf.mask[lo:hi])
        return ids, labels

    def truncation(self) -> tuple[int, int]:
        """(examples longer than seq_len, of those the ones left with no label token): the first token
        is never a target (the loss predicts token p from the tokens before it), so it does not count."""
        cut = lost = 0
        for tf in self.files:
            lens = np.diff(np.asarray(tf.offsets))
            long = np.nonzero(lens > self.seq_len)[0]
            cut += int(long.size)
            for r in long:
                lo = int(tf.offsets[r])
                lost += not np.asarray(tf.mask[lo + 1 : lo + self.seq_len]).any()
        return cut, lost


class Subset:
    """Items [lo, hi) of another source (the held-out tail, or the rest)."""

    def __init__(self, source: Packed | Padded, lo: int, hi: int):
        self.source, self.lo, self.hi = source, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def item(self, i: int) -> Item:
        return self.source.item(self.lo + i)


Source = Packed | Padded | Subset


def stack(source: Source, index: np.ndarray | range) -> tuple[torch.Tensor, ...]:
    """The items' arrays stacked into [items, seq_len] tensors: (ids, labels[, positions])."""
    rows = [source.item(int(i)) for i in index]
    return tuple(torch.from_numpy(np.stack(column)) for column in zip(*rows))


@dataclass
class Order:
    """Which items batch t holds (the contract above)."""

    items: int
    batch_size: int
    shuffle: bool
    seed: int

    def __post_init__(self) -> None:
        self.per_epoch = self.items // self.batch_size
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            perm = (
                np.random.default_rng([self.seed, epoch]).permutation(self.items)
                if self.shuffle
                else np.arange(self.items)
            )
            self._perm = (epoch, perm)
        return self._perm[1]

    def batch(self, t: int) -> tuple[int, np.ndarray]:
        """(epoch, item indices) of batch t."""
        epoch, k = divmod(t, self.per_epoch)
        return epoch, self.permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
