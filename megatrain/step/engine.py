"""The step: streaming forward, block-wise recompute + backward, chunked loss. Device-agnostic.

The engine never owns weights. It asks a WeightSource for each unit's flat weight vector, in the
order the source's plan implies (forward, head, then its checkpoint blocks recomputed in reverse: the
data-plane protocol in megatrain.ipc.protocol owns that plan), binds views of it into stateless HF
layer templates, and hands each unit's flat gradient to a GradSink the moment it is complete (head,
layers last to first, embedding; with sequence chunks, in the backward of the last chunk). The
executor actor plugs in the shared-memory source and sink; tests plug in plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from megatrain.collective import Group
from megatrain.config.engine import FIXED_SIZES as FIXED_SIZES  # the engine section, re-exported
from megatrain.config.engine import EngineConfig as EngineConfig
from megatrain.config.engine import fixed_sizes as fixed_sizes
from megatrain.config.engine import resolve_engine as resolve_engine
from megatrain.layers.documents import LayerContext, documents_of, layer_context
from megatrain.layers.head import ChunkedHead, chunked_loss
from megatrain.layers.labels import IGNORE, targets
from megatrain.layers.moe import RouterStats
from megatrain.model.spec import ModelSpec
from megatrain.step.activations import Checkpoints, host_checkpoints
from megatrain.step.templates import Templates


def resolve_device(cfg: EngineConfig, rank: int = 0) -> torch.device:
    """The executor's device. Executor `rank` takes the rank-th GPU it sees: one process per executor sees
    only its own GPU (Ray's placement), executors in one process see them all. Not the thread's current
    device: in one process another run's executor may have set it (NCCL then finds two ranks on one GPU)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.compute_dtype]


class _BatchUpload:
    """ids and labels (and positions) onto the device without blocking the host. A copy from pageable
    memory would synchronize the stream, and pinning a fresh buffer each step goes through cudaFree: the
    profiler's check found both at the loop's start. So one pinned buffer, reused once the last copy is done."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def __call__(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Int64 tensors of one shape, in one copy."""
        if self.device.type != "cuda":
            return tuple(r.to(self.device) for r in rows)
        if self.host is None or self.host.shape != (len(rows), *rows[0].shape):
            self.host = torch.empty((len(rows), *rows[0].shape), dtype=torch.long, pin_memory=True)
        elif self.done is not None and not self.done.query():
            self.done.synchronize()  # only if a caller never waited for the previous step
        for dst, r in zip(self.host, rows):
            dst.copy_(r)
        out = self.host.to(self.device, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(self.device))
        return tuple(out)


class WeightSource(Protocol):
    """Serves weights in the order of the data-plane plan; `blocks` are the plan's checkpoint blocks (lists
    of layer units; the last is never recomputed), which the engine follows rather than derives, so the
    order it fetches in is the order the store serves in by construction."""

    blocks: list[list[int]]

    def fetch(self, unit: int) -> torch.Tensor:
        """The unit's flat weights on the compute device, in compute dtype, owned by the caller."""


class GradSink(Protocol):
    def emit(self, unit: int, grad: torch.Tensor) -> None:
        """Take the unit's complete flat gradient (on the device); may copy it out asynchronously."""


@dataclass
class _Act:
    unit: int
    x: torch.Tensor
    out: torch.Tensor


@dataclass
class StepResult:
    loss: torch.Tensor  # mean token loss of the step (device scalar): the language-model loss
    tokens: torch.Tensor  # tokens that carried a label (device scalar)
    routers: RouterStats | None = None  # MoE: the step's expert load and load-balancing loss (megatrain/layers/moe.py)


class _Block:
    """One checkpoint block's weights (fetched on first use) and fp32 gradient sums over chunks."""

    def __init__(self, units: list[int], src: WeightSource, sink: GradSink, chunks: int):
        self.units, self.src, self.sink, self.chunks = units, src, sink, chunks
        self.flats: dict[int, torch.Tensor] = {}
        self.sums: dict[int, torch.Tensor] = {}

    def weights(self, unit: int) -> torch.Tensor:
        if unit not in self.flats:
            self.flats[unit] = self.src.fetch(unit).requires_grad_(True)
        return self.flats[unit]

    def collect(self, unit: int, final: bool) -> None:
        """Take this chunk's gradient of `unit`; in the final chunk it is complete and leaves at once
        (the backward visits units in reverse, which is the protocol's gradient order)."""
        flat = self.flats[unit]
        if self.chunks == 1:
            grad = flat.grad  # a whole batch in one chunk needs no sum
        elif unit in self.sums:
            grad = self.sums.pop(unit)
            grad += flat.grad  # fp32 += compute dtype: the sum itself is fp32
        else:
            grad = flat.grad.float()
        flat.grad = None  # the next chunk's backward must not accumulate in the compute dtype
        if final:
            self.sink.emit(unit, grad)
            del self.flats[unit]
        else:
            self.sums[unit] = grad


class StepEngine:
    def __init__(self, spec: ModelSpec, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
        cfg = fixed_sizes(cfg)  # the driver resolves them (autosize.py); a bare engine (tests) takes these
        self.spec, self.cfg, self.device, self.dtype = spec, cfg, device, dtype
        self.t = Templates(spec, device, cfg.moe_experts)
        self.t.use_tiles(cfg.token_tile)
        self.n = spec.layout.num_layers
        self.blocks: list[list[int]] = []
        self.checkpoints = Checkpoints(device, host_checkpoints(cfg.offload_checkpoints, self.n))
        self.upload = _BatchUpload(device)
        self.mark: Callable[[str], None] = lambda name: None
        # Several executors (megatrain/collective.py): each runs its rows of the batch; the loss is
        # normalized by the labelled tokens of the whole batch and the routers count over all of it.
        self.group: Group | None = None

    def step(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        src: WeightSource,
        sink: GradSink,
        mark: Callable[[str], None] = lambda name: None,
        positions: torch.Tensor | None = None,
    ) -> StepResult:
        """One step's forward and backward. `mark(name)` is called at phase and layer boundaries
        (the executor records CUDA events there for the time split and the timeline). `positions`: see
        megatrain/layers/documents.py (data.pack_documents; [B, S] int64 on the host).

        Every layer processes the batch in chunks of `chunk_sequences` sequences; the last block runs
        forward, head and backward chunk by chunk, earlier blocks are recomputed chunk by chunk from
        their checkpoint, and each layer's gradient is summed over chunks in fp32 before it leaves.
        """
        self.mark = mark
        self.blocks = src.blocks  # the plan's, whatever engine.checkpoint_interval says
        mark("forward")
        moe = self.t.moe
        if moe is not None:
            moe.reset()
            moe.counting = True
        documents = documents_of(ids, positions)  # on the host, before the upload
        ids, labels, *uploaded = self.upload(ids, labels, *([] if positions is None else [positions]))
        chunks = self._chunks(ids.shape[0])
        emb_flat = src.fetch(0)
        with torch.no_grad():
            h = F.embedding(ids, self.t.embed_weight(emb_flat), self.t.pad_id)
        ctx = layer_context(self.t.rotary, h, uploaded[0] if uploaded else None, documents)
        h = self._forward(h, ctx, src, chunks)
        if not self.spec.layout.tied:
            emb_flat = None  # the untied embedding's backward needs only the token ids
        self.checkpoints.prefetch(len(self.blocks) - 2)
        loss, tokens, g, tied_grad = self._last_block_and_head(h, ctx, labels, emb_flat, src, sink, chunks)
        for b in range(len(self.blocks) - 2, -1, -1):
            h = self.checkpoints.get(b)
            self.checkpoints.prefetch(b - 1)
            g = self._recompute_backward(_Block(self.blocks[b], src, sink, len(chunks)), h, g, ctx, chunks)
        mark("embed-bwd")
        self._embed_backward(ids, g, tied_grad, sink)
        mark("end")
        return StepResult(loss, tokens, moe)

    @torch.no_grad()
    def evaluate(
        self, ids: torch.Tensor, labels: torch.Tensor, src: WeightSource, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only, over forward_order: (sum of the token losses, tokens with a label), on the device.

        No graph, no recompute and no gradients; the head runs in loss_chunk_tokens chunks as in a step."""
        ids, labels = ids.to(self.device), labels.to(self.device)
        h, emb_flat = self._plain_forward(ids, src, positions)
        head_flat = src.fetch(self.n + 1)
        tgt = targets(labels).reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=self.device)

        def logits_of(x: torch.Tensor) -> torch.Tensor:
            return self.t.head(head_flat, emb_flat, x)

        chunked_loss(logits_of, h.reshape(-1, h.shape[-1]), tgt, self.cfg.loss_chunk_tokens, total)
        return total, (tgt != IGNORE).sum()

    @torch.no_grad()
    def predict(self, ids: torch.Tensor, pos: torch.Tensor, src: WeightSource) -> torch.Tensor:
        """Forward only, over forward_order: per row, the most likely token after position pos[row]."""
        ids, pos = ids.to(self.device), pos.to(self.device)
        h, emb_flat = self._plain_forward(ids, src)
        last = h[torch.arange(h.shape[0], device=self.device), pos]
        return self.t.head(src.fetch(self.n + 1), emb_flat, last).float().argmax(-1)

    def _plain_forward(
        self, ids: torch.Tensor, src: WeightSource, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding and every layer once (under the caller's no_grad); the embedding's weights are kept
        only when the head needs them (tied)."""
        documents = documents_of(ids, positions)
        emb_flat = src.fetch(0)
        h = F.embedding(ids, self.t.embed_weight(emb_flat), self.t.pad_id)
        ctx = layer_context(self.t.rotary, h, positions, documents)
        chunks = self._chunks(ids.shape[0])  # the training step's sequence chunks bound memory here too
        for u in range(1, self.n + 1):
            w = src.fetch(u)
            h = _per_chunk(h, chunks, lambda c, _, u=u, w=w, x=h: self.t.layer(u, w, x[c], ctx.rows(c)))
        return h, (emb_flat if self.spec.layout.tied else None)

    def _chunks(self, batch: int) -> list[slice]:
        size = self.cfg.chunk_sequences or batch
        return [slice(s, min(s + size, batch)) for s in range(0, batch, size)]

    def _forward(self, h: torch.Tensor, ctx: LayerContext, src: WeightSource, chunks: list[slice]) -> torch.Tensor:
        """No-grad forward through every block but the last, checkpointing each block's input."""
        for b, blk in enumerate(self.blocks[:-1]):
            self.checkpoints.put(b, h)
            with torch.no_grad():
                for u in blk:
                    w = src.fetch(u)
                    self.mark(f"fwd:{u}")
                    h = _per_chunk(h, chunks, lambda c, _, u=u, w=w, x=h: self.t.layer(u, w, x[c], ctx.rows(c)))
        return h

    def _with_grad(
        self, blk: _Block, h: torch.Tensor, ctx: LayerContext, c: slice, phase: str, lean: int = 0
    ) -> list[_Act]:
        """The block's layers with grad on chunk `c` of h's rows; the first `lean` keep only what lean.py saves."""
        acts, h, ctx = [], h[c], ctx.rows(c)
        for i, u in enumerate(blk.units):
            flat = blk.weights(u)
            self.mark(f"{phase}:{u}")
            x = h.detach().requires_grad_(True)
            h = self.t.layer(u, flat, x, ctx, lean=i < lean)
            acts.append(_Act(u, x, h))
        return acts

    def _backward(self, blk: _Block, acts: list[_Act], g: torch.Tensor, final: bool) -> torch.Tensor:
        while acts:
            a = acts.pop()
            self.mark(f"bwd:{a.unit}")
            torch.autograd.backward(a.out, g)
            blk.collect(a.unit, final)
            g = a.x.grad
        return g

    def _recompute_backward(
        self, blk: _Block, h: torch.Tensor, g: torch.Tensor, ctx: LayerContext, chunks: list[slice]
    ) -> torch.Tensor:
        return _per_chunk(
            g, chunks, lambda c, final: self._backward(blk, self._with_grad(blk, h, ctx, c, "recompute"), g[c], final)
        )

    def _last_block_and_head(
        self,
        h: torch.Tensor,
        ctx: LayerContext,
        labels: torch.Tensor,
        emb_flat: torch.Tensor | None,
        src: WeightSource,
        sink: GradSink,
        chunks: list[slice],
    ):
        """Per chunk: forward through the last block with grad, head + loss, backward into the block."""
        blk = _Block(self.blocks[-1], src, sink, len(chunks))
        tgt = targets(labels)
        tokens = (tgt != IGNORE).sum()
        every = self.group.all_reduce_(tokens.clone()) if self.group is not None else tokens
        head = ChunkedHead(self.t.head, self.cfg.loss_chunk_tokens, self.device, emb_flat, every.clamp(min=1).float())
        moe = self.t.moe
        counted = moe is not None and moe.inject and len(chunks) > 1
        if counted:  # the first chunk's backward needs every chunk's routing (megatrain/layers/moe.py)
            self._count_routing(blk, h, ctx, chunks)
            moe.counted(self.group)

        def one(c: slice, final: bool) -> torch.Tensor:
            if moe is not None:
                moe.counting = not counted
            acts = self._with_grad(blk, h, ctx, c, "fwd", self.cfg.lean_layers)
            if moe is not None:
                moe.counting = False  # the backward's recomputes (lean, tiles) route the same tokens again
                if final and not counted:
                    moe.counted(self.group)  # every row of the step is counted: before any aux gradient
            if head.flat is None:
                head.flat = src.fetch(self.n + 1).requires_grad_(True)
            self.mark("head")
            g_out = head.chunk(acts[-1].out, tgt[c])
            if final:
                sink.emit(self.n + 1, head.sums[0])  # the head's gradient is first in the protocol's order
            return self._backward(blk, acts, g_out, final)

        g = _per_chunk(h, chunks, one)
        return head.loss, tokens, g, (head.sums[1] if len(head.sums) > 1 else None)

    @torch.no_grad()
    def _count_routing(self, blk: _Block, h: torch.Tensor, ctx: LayerContext, chunks: list[slice]) -> None:
        """A forward of the last block over every chunk that only counts the routers' statistics."""
        for c in chunks:
            x = h[c]
            for u in blk.units:
                x = self.t.layer(u, blk.weights(u), x, ctx.rows(c))
        self.t.moe.counting = False

    def _embed_backward(self, ids: torch.Tensor, g: torch.Tensor, tied: torch.Tensor | None, sink: GradSink) -> None:
        vocab, hidden = self.spec.layout.structure_of(0).slots[0].shape
        grad = tied if tied is not None else torch.zeros(vocab * hidden, dtype=torch.float32, device=self.device)
        rows = grad.view(vocab, hidden)
        g = g.reshape(-1, hidden).float()
        if self.t.pad_id is not None:  # F.embedding(padding_idx=...) sends no gradient through pad lookups
            g = g.masked_fill(ids.reshape(-1, 1) == self.t.pad_id, 0.0)
        rows.index_add_(0, ids.reshape(-1), g)
        sink.emit(0, grad)


def _per_chunk(x: torch.Tensor, chunks: list[slice], fn: Callable[[slice, bool], torch.Tensor]) -> torch.Tensor:
    """fn(chunk, is_final) for each sequence chunk of x's batch, the results put back in one tensor;
    with one chunk fn's result is returned as is (no copy on the common path)."""
    if len(chunks) == 1:
        return fn(chunks[0], True)
    out = torch.empty_like(x)
    for c in chunks:
        out[c] = fn(c, c is chunks[-1])
    return out
