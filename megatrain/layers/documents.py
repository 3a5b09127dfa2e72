"""What every layer call of a step takes besides its input, and packed documents (data.pack_documents).

Without positions a layer sees position ids 0..S-1 shared by every row ([1, S], broadcast), and RoPE's
cos/sin for them. With positions (each token's offset inside its document, [B, S]) RoPE is per row and
the lengths of each row's documents go to the attention function (megatrain/layers/attention.py) as the
`documents` layer kwarg, which then attends within each document only. The lengths are computed on the
host from the host's positions, before the upload: the attention loop needs them as Python ints, and
reading them back from the device would stall the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Documents = list[list[int]]  # per row, the lengths of its documents in order (they sum to the row's length)


@dataclass
class LayerContext:
    pos: tuple[torch.Tensor, torch.Tensor]  # RoPE's (cos, sin): [1, S, dim], or [B, S, dim] with positions
    pos_ids: torch.Tensor  # [1, S] or [B, S]
    documents: Documents | None = None  # None: every row is one causal sequence

    def rows(self, c: slice) -> LayerContext:
        """The context of a chunk of the batch's rows; the broadcast one serves any chunk as it is."""
        if self.documents is None:
            return self
        cos, sin = self.pos
        return LayerContext((cos[c], sin[c]), self.pos_ids[c], self.documents[c])

    def kwargs(self) -> dict:
        """The decoder layer's keyword arguments (the engine runs it without a mask: causal attention)."""
        kw = {"position_embeddings": self.pos, "position_ids": self.pos_ids, "attention_mask": None}
        if self.documents is not None:
            kw["documents"] = self.documents
        return kw


def documents_of(ids: torch.Tensor, positions: torch.Tensor | None) -> Documents | None:
    """Per row of [B, S] positions, its documents' lengths: a document starts where the position is 0
    (and at each row's first token). None without positions."""
    if positions is None:
        return None
    if positions.shape != ids.shape or positions.dtype != torch.long:
        raise ValueError(
            f"positions must be int64 of the ids' shape {tuple(ids.shape)}, not {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    pos = positions.cpu().numpy()
    rows, seq = pos.shape
    starts = pos == 0
    starts[:, 0] = True
    r, c = np.nonzero(starts)
    bounds = np.split(c, np.searchsorted(r, np.arange(1, rows)))
    return [np.diff(np.append(b, seq)).tolist() for b in bounds]


def layer_context(
    rotary: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor | None, documents: Documents | None
) -> LayerContext:
    """The step's context for embeddings `h` ([B, S, hidden]) and `positions` (None: 0..S-1 for every row)."""
    pos_ids = torch.arange(h.shape[1], device=h.device)[None] if positions is None else positions.to(h.device)
    with torch.no_grad():
        pos = rotary(h, pos_ids)
    return LayerContext(pos, pos_ids, documents)
