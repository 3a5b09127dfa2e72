"""`auto` engine sizes: the fastest setting that fits the GPU memory actually free.

What costs time, what costs memory (one step, L layers, K = engine.checkpoint_interval):
  * every layer outside the last block is recomputed once in the backward (about a third of its
    forward+backward again, and its weights cross PCIe again); a layer in the last block is not, but
    keeps its activations on the GPU from its forward to its backward. So the last block gets as many
    layers as the free memory holds: that is the speed lever.
  * a lean layer (megatrain/step/lean.py) keeps only its GEMM and attention outputs and remakes the rest
    in its backward: about half the bytes for about a tenth of its time (bench/lean.py), against a
    whole forward and a second weight transfer for a layer left out of the last block. So the last
    block takes as many layers as fit when lean, and the fewest of them are made lean (its first
    ones) that let it fit: where every layer fits whole, none.
  * the last block's activations are freed by its backward before any recompute block runs, so the
    recompute blocks (K layers each) need room for K layers at once, not in addition. K itself barely
    changes the time (the recompute is one forward per layer whatever K), and each block keeps one
    activation checkpoint from the forward to its recompute, so K is as large as that room holds (whole
    layers with their weights, up to the layers left): few checkpoints. They stay on the GPU where they
    take at most an eighth of the room (engine.offload_checkpoints: auto; the last block makes room for
    them), else they go to pinned host RAM. With sequence chunks K stays 2 (1 when the GPU holds fewer
    than 2 layers' activations).
  * the batch runs through each layer in chunks of engine.chunk_sequences: whole when K layers of the
    whole batch fit, else the largest chunk that does (smaller chunks run the GEMMs less efficiently).
  * with clipping, the last block can also take every layer by running the batch in sequence chunks
    (its forward, head and backward go chunk by chunk, so its activations follow the chunk; each of its
    layers then keeps an fp32 gradient sum until the last chunk). Its gradients then all leave in the
    last chunk's backward: that costs nothing with clipping, where no update starts before the last
    gradient anyway, but without clipping it takes the updates' overlap with the backward away (measured
    on 28 layers at 16x4096: every layer in 8 chunks 8.17 s, against 7.31 s with 7 layers and the
    recompute). So: clipping on, at least a quarter of the layers' recompute saved, chunks of at least
    MIN_CHUNK_TOKENS tokens (8192-token chunks ran the backward's GEMMs 8 % slower), the fewest chunks
    that fit (8 layers at 158x1024: 4 chunks of 40 sequences, 5.32 s against 5.87 s with 2 layers).
  * the LM head and loss run in chunks of engine.loss_chunk_tokens tokens, whose [tokens, vocab] logits
    (bf16, their fp32 upcast and its gradient: about 12 bytes per element) are the head's peak: 8192
    tokens where that is at most an eighth of the budget (larger chunks run the head's GEMMs faster).
Memory model, calibrated on the Qwen2.5-7B layer (bf16) against four measured GPU peaks (8 layers at
16x4096 with 1 and 2 layers in the last block and 2048/8192-token loss chunks; 28 layers with 6; 8
layers at 158x1024 with 2; all within 1.3 GiB):
  peak = weight buffers + loss chunk + tokens·12·hidden·dtype (hidden-state copies, the checkpoint in
         flight, the head's input; 6 with token tiles, see stream_bytes) + whole layers of the last block
         · tokens·(4·hidden + 5.5·intermediate + e)·dtype (e: the widths of q, its output, k and v beyond
         those of heads hidden_size / heads wide, where head_dim is another) + its lean layers · (tokens·(3·hidden
         + 2·q + 2·kv + 2·intermediate)·dtype + their weights; a MoE layer on our expert path: the GEMM
         outputs it caches, counted from its structure, memory/layer.py), and an all-lean block one whole
         layer more (its top layer's backward remakes it)
         + with sequence chunks, an fp32 gradient sum per layer kept (in the last block, or K layers)
and it must stay under 92 % of the free memory the executor measured after its CUDA context.
On the CPU device nothing is scarce in this sense: the previous fixed defaults (K 2, last block K,
whole batch, 2048-token loss chunks).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megatrain.config.engine import FIXED_SIZES, EngineConfig
from megatrain.errors import ResourceError
from megatrain.memory.host import host_checkpoints
from megatrain.memory.layer import OUR_EXPERTS, lean_layer_bytes, mlp_width, our_layer_bytes, sparse_every_layer
from megatrain.model.arch import Arch, arch_of_spec
from megatrain.step.blocks import blocks

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

GIB = 2**30
LOSS_BYTES = 12  # per logit element: bf16 logits, fp32 upcast, fp32 gradient of the upcast
MARGIN = 0.92  # of the free memory: the allocator's fragmentation and cuBLAS workspaces
MIN_CHUNK_TOKENS = 32768  # a sequence chunk the last block is chunked for runs its GEMMs at full speed
TILE_TOKENS = 16384  # an MLP tile of a 7B layer: 1.8 GiB in flight, GEMMs of 16k rows at full speed
STREAM_COPIES, TILED_STREAM_COPIES = 12, 10  # hidden-state copies beside the kept activations (stream_bytes)
# Our expert path's MoE layers hold more on the GPU than autograd saves for them on the CPU, which
# our_layer_bytes counts within 3 %: OLMoE-1B-7B's layer at 16x4096 tokens took 7.57 GiB of an H200's peak
# per layer (16 layers against 8), 1.15x the 6.57 counted. With the factor the plan's peaks are 0-6 % over those
# measured with every layer in the last block (OLMoE-1B-7B 8 and 16 layers, GPT-OSS-20B 6, Qwen3-30B-A3B 8),
# where the count alone was 5-11 % under. A lean layer's activations on that path take the same factor: GPT-OSS-20B
# whole with 21 of 24 layers lean peaked at 131.4 GiB on an H200, the plan 134.1 without it and 141.2 with it.
OUR_GPU_EXCESS = 1.15
# The way out of a GPU too small for one sequence, and where to see why: the plan, which prints the error,
# strips both (its suggestions say the first once, and it is the plan).
SEQ_ADVICE = "; use a shorter data.seq_len or a GPU with more free memory"
PLAN_HINT = " (megatrain-launch plan CONFIG shows the whole plan)"


@dataclasses.dataclass(frozen=True)
class Sizes:
    checkpoint_interval: int
    last_block_layers: int
    chunk_sequences: int
    loss_chunk_tokens: int
    lean_layers: int
    offload_checkpoints: bool | int = True  # all, none, or the first N blocks' in pinned host RAM
    token_tile: int = 0

    def __str__(self) -> str:  # the line the driver logs and `megatrain-launch plan` prints
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))


def as_arch(model: Arch | ModelSpec) -> Arch:
    """The shape the memory model reads: an Arch as it is, a run's built ModelSpec as its Arch."""
    return model if isinstance(model, Arch) else arch_of_spec(model)


def layer_activation_bytes(
    model: Arch | ModelSpec, tokens: int, dtype_bytes: int, tile: int = 0, experts: str = "hf"
) -> int:
    """One decoder layer's activations kept for its backward, for `tokens` tokens; with token tiles
    (megatrain/step/tiling.py), its attention half's (q, k, v, the attention output, the log-sum-exp and three
    hidden-state copies: the input, the normed input and the MLP half's input), plus one tile's worth of an
    untiled layer: the tile in flight. Calibrated with stream_bytes on the tiled runs measured. `experts`:
    engine.moe_experts (what a mixture of experts' routed rows keep: mlp_width); on our expert path a MoE
    layer is counted from its structure instead (our_layer_bytes, with OUR_GPU_EXCESS), the dense rule's
    coefficients having been fitted where the MLP's term absorbs the norms' and attention's excess."""
    arch = as_arch(model)
    if not tile or tile >= tokens:
        width = 8 * arch.hidden_size + 11 * mlp_width(arch, experts) + 2 * _attention_excess(arch)  # half dtypes
        dense = int(tokens * width * dtype_bytes // 2)
        if experts != OUR_EXPERTS or not arch.is_moe:
            return dense
        ours = int(tokens * our_layer_bytes(arch, dtype_bytes, tokens) * OUR_GPU_EXCESS) + 4 * arch.num_experts
        return ours if sparse_every_layer(arch) else max(ours, dense)
    q, kv = arch.attention_widths
    kept = tokens * ((3 * arch.hidden_size + 2 * q + 2 * kv) * dtype_bytes + 4 * arch.num_attention_heads)
    return kept + layer_activation_bytes(arch, tile, dtype_bytes, experts=experts)


def _attention_excess(arch: Arch) -> int:
    """Per token, what a layer's attention keeps (q and its output, k and v) beyond the widths that heads of
    hidden_size / heads would have, which the calibrated `8·hidden` counts: nonzero where the config's
    head_dim is another (Qwen3-30B-A3B: 128 at 2048 / 32 heads, twice the calibrated q)."""
    q, kv = arch.attention_widths
    kv_heads = kv // arch.head_dim
    return 2 * (q - arch.hidden_size) + 2 * (kv - arch.hidden_size * kv_heads // arch.num_attention_heads)


def token_tile(model: Arch | ModelSpec, tokens: int, experts: str = "hf") -> int:
    """The tile an `auto` engine.token_tile takes where a layer's untiled activations do not fit: TILE_TOKENS,
    or fewer where the layer is so wide that one tile would take more than a layer of attention half."""
    arch = as_arch(model)
    tile = TILE_TOKENS
    width = 8 * arch.hidden_size + 11 * mlp_width(arch, experts)
    if experts == OUR_EXPERTS and arch.is_moe:  # per token at 2-byte dtypes, as the untiled layer counts it
        width = max(int(our_layer_bytes(arch, 2, tokens) * OUR_GPU_EXCESS), width)
    while tile > 1024 and tile * width > tokens * 8 * arch.hidden_size:
        tile //= 2
    return min(tile, tokens)


def stream_bytes(model: Arch | ModelSpec, tokens: int, dtype_bytes: int, tile: int = 0) -> int:
    """What grows with the tokens outside the kept activations: hidden-state copies (the last block's input,
    the head's input gradient, the gradient flowing down and the one a layer's backward makes), the
    checkpoint in flight, and the transients of the layer whose backward runs. Untiled, those transients
    are the whole sequence's MLP gradients: 12 hidden-state copies in all, calibrated at 16x4096 and
    158x1024 tokens. With token tiles the MLP's follow the tile (counted in the layer's term) and the
    attention backward's (its gradients of q, k, v and output, an fp32 accumulator, the norms' fp32
    upcasts) dominate: 10 copies, calibrated with the tiled layer's term on the 7B shape's peaks at 1x524288
    tokens (8 and 28 layers) and 8 layers at 1x1048576 (an H200; within 5 % of each)."""
    arch = as_arch(model)
    copies = TILED_STREAM_COPIES if tile and tile < tokens else STREAM_COPIES
    return tokens * copies * arch.hidden_size * dtype_bytes


def buffer_bytes(model: Arch | ModelSpec, prefetch: int, dtype_bytes: int) -> int:
    """Weight buffers: the unit computing and `prefetch` loading ahead, a decoder layer each (larger units
    stream through them in layer-sized pieces)."""
    arch = as_arch(model)
    return _layer_numel(arch) * (prefetch + 1) * dtype_bytes


def sum_bytes(model: Arch | ModelSpec, layers: int) -> int:
    """fp32 gradient sums over sequence chunks, one per layer of a block that runs in chunks."""
    arch = as_arch(model)
    return layers * _layer_numel(arch) * 4


def _layer_numel(arch: Arch) -> int:
    return max(arch.layout.structure_of(u.index).numel for u in arch.layout.units if u.kind == "layer")


def choose(
    model: Arch | ModelSpec,
    cfg: EngineConfig,
    batch: int,
    seq: int,
    gpu_free: int | None,
    clip: bool,
    host_room: int | None = None,
) -> tuple[Sizes, str]:
    """The sizes for the `auto` fields of `cfg` (explicit values are kept), and why, in one line. `clip`:
    whether the run clips the global gradient norm (no update starts before the last gradient).
    `host_room`: the host RAM the executor's pinned checkpoints may take beside the store and the processes
    (None: not known here; then they all go to host memory when they leave the GPU, and the store owner
    checks the host)."""
    arch = as_arch(model)
    if gpu_free is None:
        return _keep(cfg, Sizes(**FIXED_SIZES)), "the CPU device: fixed defaults"
    dtype_bytes = 2 if cfg.compute_dtype == "bf16" else 4
    budget = _usable(arch, gpu_free, dtype_bytes) - buffer_bytes(arch, cfg.prefetch, dtype_bytes)
    loss = _loss_chunk(arch.vocab_size, budget)
    room = budget - loss * arch.vocab_size * LOSS_BYTES  # before the hidden states, which tiles change
    tile = 0 if cfg.token_tile == "auto" else cfg.token_tile
    budget = room - stream_bytes(arch, batch * seq, dtype_bytes, tile)
    shape = _Shape(arch, cfg, batch, seq, dtype_bytes, clip, gpu_free, tile)
    try:
        plan = _explicit(cfg, shape.blocks(budget))
    except ResourceError:  # one sequence's layer does not fit whole: its MLP half in tiles (auto only)
        if cfg.token_tile != "auto":
            raise
        tile = token_tile(arch, seq, cfg.moe_experts)
        budget = room - stream_bytes(arch, batch * seq, dtype_bytes, tile)
        shape = _Shape(arch, cfg, batch, seq, dtype_bytes, clip, gpu_free, tile)
        plan = _explicit(cfg, shape.blocks(budget))
    offload = cfg.offload_checkpoints
    each = checkpoint_bytes(arch, batch * seq, dtype_bytes)
    if offload == "auto":  # on the GPU where they take at most an eighth of the room (see the docstring)
        kept = shape.with_checkpoints(budget, each, limit=budget // 8)
        offload = kept is None and _saved(arch, plan) > 0
        plan = plan if kept is None else kept
        if offload and host_room is not None and _saved(arch, plan) * each > host_room:
            plan, offload = _split(shape, plan, budget, each, max(host_room, 0) // each)
    elif offload is False:
        plan = shape.with_checkpoints(budget, each, limit=budget) or plan
    elif offload is not True:  # a count in host memory: the rest on the GPU
        plan = shape.with_checkpoints(budget, each, limit=budget, on_host=offload) or plan
    k, last, chunk, lean, why = plan
    saved = _saved(arch, plan)
    on_host = host_checkpoints(offload, saved)
    where = (
        "none"
        if not saved
        else f"{saved} on the GPU"
        if not on_host
        else f"{saved} in pinned host RAM"
        if on_host == saved
        else f"{on_host} in pinned host RAM (as many as the host holds), {saved - on_host} on the GPU"
    )
    if tile and cfg.token_tile == "auto":
        why += f"; the MLP half in tiles of {tile} tokens"
    why += f"; activation checkpoints: {where}"
    return _keep(cfg, Sizes(k, last, chunk, loss, lean, offload, tile)), why


def _usable(arch: Arch, gpu_free: int, dtype_bytes: int) -> int:
    """What the modelled terms may take of `gpu_free`: its MARGIN, and never the room the largest unit's
    weights and fp32 gradient need (the margin covers them on a large GPU, not on a small one or a budget)."""
    return min(int(gpu_free * MARGIN), gpu_free - arch.layout.max_unit_numel * (dtype_bytes + 4))


def _split(shape: _Shape, plan: tuple, budget: int, each: int, on_host: int) -> tuple[tuple, bool | int]:
    """Where the checkpoints do not all fit the host: `on_host` of them there (the first blocks'), the rest on
    the GPU, with a plan whose budget holds those; where none does, all in host memory (the store owner
    then refuses the run, saying by how much the host is short)."""
    split = shape.with_checkpoints(budget, each, limit=budget, on_host=on_host)
    if split is None:
        return plan, True
    return split, (on_host if on_host else False)


class _Shape:
    """The sizing of one run's blocks for a given activation budget."""

    def __init__(
        self,
        arch: Arch,
        cfg: EngineConfig,
        batch: int,
        seq: int,
        dtype_bytes: int,
        clip: bool,
        gpu_free: int,
        tile: int = 0,
    ):
        self.arch, self.cfg, self.batch, self.seq, self.dtype_bytes = arch, cfg, batch, seq, dtype_bytes
        self.clip, self.gpu_free, self.tile = clip, gpu_free, tile
        self.per_layer = layer_activation_bytes(arch, batch * seq, dtype_bytes, tile, cfg.moe_experts)

    def _layer(self, tokens: int) -> int:
        return layer_activation_bytes(self.arch, tokens, self.dtype_bytes, self.tile, self.cfg.moe_experts)

    def blocks(self, budget: int) -> tuple[int, int, int, int, str]:
        """(K, last block layers, sequences per chunk, lean layers, why) for `budget` bytes of activations."""
        arch, cfg, batch, seq, per_layer = self.arch, self.cfg, self.batch, self.seq, self.per_layer
        layers = arch.layout.num_layers
        fit = max(budget // per_layer, 0)
        k = 2 if fit >= 2 and layers >= 2 else 1
        room = budget - sum_bytes(arch, k)  # chunks keep an fp32 gradient sum per layer of the block
        # only a batch run in chunks keeps the gradient sums: K whole layers that fit need none
        one = self._layer(seq)  # a tiled one keeps a tile's worth
        if k * per_layer > budget and k * one > room and cfg.chunk_sequences == "auto":
            raise ResourceError(
                f"the GPU cannot hold one sequence of {seq} tokens through {k} layer(s): {self.gpu_free / GIB:.1f} "
                f"GiB free, {max(room, 0) / GIB:.1f} GiB of it left for activations after the weight buffers, the "
                f"loss chunk, the hidden states and the chunks' gradient sums, one sequence needs "
                f"{k * one / GIB:.2f} GiB{SEQ_ADVICE}{PLAN_HINT}"
            )
        chunk = 0 if k * per_layer <= budget else self._chunk(room, k)
        # A tiled layer keeps about what a lean one does (its MLP half is recomputed per tile): no lean layers.
        cost = (
            per_layer,
            per_layer if self.tile else lean_bytes(arch, batch * seq, self.dtype_bytes, cfg.moe_experts),
            budget,
        )
        chunked = 0 < (chunk if cfg.chunk_sequences == "auto" else cfg.chunk_sequences) < batch
        if chunked:  # sequence chunks are what make the batch fit, not lean layers: the whole batch's fit
            last, lean = max(min(fit, layers), 1), (0 if cfg.lean_layers == "auto" else cfg.lean_layers)
        else:
            last, lean = _last_block(
                layers, k if cfg.last_block_layers == 0 else cfg.last_block_layers, cfg.lean_layers, cost
            )
        why = (
            f"{self.gpu_free / GIB:.1f} GiB free on the GPU, {max(budget, 0) / GIB:.1f} GiB left for layer "
            f"activations; one layer's {per_layer / GIB:.2f} GiB for {batch}x{seq} tokens, a lean one's "
            f"{cost[1] / GIB:.2f}"
        )
        both_auto = cfg.last_block_layers == "auto" and cfg.chunk_sequences == "auto"
        if self.clip and both_auto and chunk == 0 and 4 * (layers - last) >= layers:
            every = _chunk_for_every_layer(arch, batch, seq, self.dtype_bytes, budget, cfg.moe_experts)
            if every:
                last, chunk, lean = layers, every, (0 if cfg.lean_layers == "auto" else cfg.lean_layers)
                why += f"; every layer in the last block, in chunks of {every} sequences (clipping on)"
        if not chunked and not chunk and cfg.checkpoint_interval == "auto":
            k = self._interval(budget, k, last)
        return k, last, chunk, lean, why

    def _chunk(self, room: int, k: int) -> int:
        """The most sequences per chunk whose K layers' activations fit `room` (a tiled layer keeps a tile's
        worth whatever the chunk: not in proportion to the sequences)."""
        chunk = max(1, int(room // (k * self.per_layer / self.batch)))
        while chunk > 1 and k * self._layer(chunk * self.seq) > room:
            chunk -= 1
        return chunk

    def _interval(self, budget: int, least: int, last: int) -> int:
        """K for a whole batch: as many layers as a recompute block can hold at once, weights included (the last
        block's activations are freed before the first recompute), up to the layers left to recompute. The
        time is the same (one recompute per layer whatever K); fewer, larger blocks keep fewer checkpoints."""
        whole = self.per_layer + _layer_numel(self.arch) * self.dtype_bytes
        rest = self.arch.layout.num_layers - (last or least)
        return max(least, min(budget // whole, rest))

    def with_checkpoints(
        self, budget: int, each: int, limit: int, on_host: int = 0
    ) -> tuple[int, int, int, int, str] | None:
        """The blocks for a budget that also holds their activation checkpoints on the GPU (`each` bytes per
        checkpoint; all but `on_host` of them), or None where those take more than `limit` bytes. Fewer layers
        in the last block mean more checkpoints, so the reservation grows until it covers what the blocks
        keep."""
        reserve = 0
        for _ in range(8):
            try:
                plan = _explicit(self.cfg, self.blocks(budget - reserve))
            except ResourceError:  # the reservation leaves too little for a layer: not this way
                return None
            need = max(_saved(self.arch, plan) - on_host, 0) * each
            if need > limit:
                return None
            if need <= reserve:
                return plan
            reserve = need
        return None


def checkpoint_bytes(model: Arch | ModelSpec, tokens: int, dtype_bytes: int) -> int:
    """One activation checkpoint: a block's input hidden state."""
    arch = as_arch(model)
    return tokens * arch.hidden_size * dtype_bytes


def _explicit(cfg: EngineConfig, plan: tuple) -> tuple:
    """A plan with the config's explicit K and last block instead of the rule's (the checkpoints they keep)."""
    k, last, *rest = plan
    return (
        k if cfg.checkpoint_interval == "auto" else cfg.checkpoint_interval,
        last if cfg.last_block_layers == "auto" else cfg.last_block_layers,
        *rest,
    )


def _saved(arch: Arch, plan: tuple) -> int:
    """Checkpoints a plan keeps: one per recompute block."""
    k, last = plan[0], plan[1]
    return len(blocks(arch.layout.num_layers, k, last)) - 1


def lean_bytes(model: Arch | ModelSpec, tokens: int, dtype_bytes: int, experts: str = "hf") -> int:
    """A lean layer's activations and weights (megatrain/step/lean.py), for `tokens` tokens; `experts`:
    engine.moe_experts (what a mixture of experts' lean layer keeps depends on the path)."""
    arch = as_arch(model)
    numel = _layer_numel(arch)
    kept = lean_layer_bytes(arch, tokens, dtype_bytes, numel, experts)
    if experts == OUR_EXPERTS and arch.is_moe:  # the GPU's excess over what is counted, as for a whole layer
        kept = numel * dtype_bytes + int((kept - numel * dtype_bytes) * OUR_GPU_EXCESS)
    return kept


def _kept_bytes(n: int, lean: int, full: int, thin: int) -> tuple[int, int]:
    """(whole layers' bytes, lean layers' bytes) of a last block of n layers, the first `lean` of them lean
    (`full`, `thin`: one whole, one lean layer). The backward runs from the block's top: the whole layers
    are freed before a lean one's backward makes its dropped tensors again (one whole layer's worth, at
    most), so only an all-lean block pays that on top of what it keeps."""
    lean = min(lean, n)
    return (n - lean) * full, lean * thin + (full - thin if lean == n > 0 else 0)


def _fits(n: int, lean: int, cost: tuple[int, int, int]) -> bool:
    """Whether a last block of n layers, the first `lean` of them lean, fits the budget (cost[2])."""
    full, thin, budget = cost
    return sum(_kept_bytes(n, lean, full, thin)) <= budget


def _fewest_lean(n: int, cost: tuple[int, int, int]) -> int | None:
    """The fewest lean layers with which a last block of n layers fits; None if none does."""
    return next((j for j in range(n + 1) if _fits(n, j, cost)), None)


def _last_block(layers: int, last, lean, cost: tuple[int, int, int]) -> tuple[int, int]:
    """(last block layers, lean layers): an `auto` last block takes as many layers as fit (with the lean
    layers given, or with as many as needed when those are `auto` too: lean layers are cheap, a recompute
    is a whole forward); `auto` lean layers are then the fewest that let that block fit."""
    if last == "auto":
        fitting = [n for n in range(1, layers + 1) if _fits(n, layers if lean == "auto" else lean, cost)]
        last = max(fitting, default=1)
    if lean == "auto":
        needed = _fewest_lean(min(last, layers), cost)
        lean = last if needed is None else needed  # nothing fits: the least memory there is
    return last, lean


def _chunk_for_every_layer(arch: Arch, batch: int, seq: int, dtype_bytes: int, budget: int, experts: str) -> int:
    """Sequences per chunk for the fewest chunks (of at least MIN_CHUNK_TOKENS tokens) in which every layer
    fits in the last block; 0 if none."""
    layers = arch.layout.num_layers
    for n in range(2, batch + 1):
        size = -(-batch // n)
        if size * seq < MIN_CHUNK_TOKENS:
            return 0
        if (
            layers * layer_activation_bytes(arch, size * seq, dtype_bytes, experts=experts) + sum_bytes(arch, layers)
            <= budget
        ):
            return size
    return 0


def gpu_terms(model: Arch | ModelSpec, cfg: EngineConfig, batch: int, seq: int, sizes: Sizes) -> dict[str, int]:
    """GPU bytes of a step at the given sizes, by the model above, term by term (megatrain-launch plan). Plus
    what the rule leaves to its margin: the head's unit (the LM head or embedding, the largest) in bf16
    and its fp32 gradient, summed over the step; that is what the margin covers at small token counts."""
    arch = as_arch(model)
    dtype_bytes = 2 if cfg.compute_dtype == "bf16" else 4
    chunk_tokens = (sizes.chunk_sequences or batch) * seq
    last = sizes.last_block_layers or sizes.checkpoint_interval
    kept = max(last, sizes.checkpoint_interval)
    lean = min(sizes.lean_layers, last)
    whole, lean_kept = _kept_bytes(
        kept,
        lean,
        layer_activation_bytes(arch, chunk_tokens, dtype_bytes, sizes.token_tile, cfg.moe_experts),
        lean_bytes(arch, chunk_tokens, dtype_bytes, cfg.moe_experts),
    )
    chunked = 0 < sizes.chunk_sequences < batch
    largest = arch.layout.max_unit_numel
    saved = len(blocks(arch.layout.num_layers, sizes.checkpoint_interval, sizes.last_block_layers)) - 1
    on_gpu = saved - host_checkpoints(sizes.offload_checkpoints, saved)
    return {
        f"weight buffers ({cfg.prefetch + 1} layers, compute dtype)": buffer_bytes(arch, cfg.prefetch, dtype_bytes),
        f"loss chunk logits ({sizes.loss_chunk_tokens} tokens x vocab, 12 B each)": sizes.loss_chunk_tokens
        * arch.vocab_size
        * LOSS_BYTES,
        "hidden states, checkpoint in flight, head input": stream_bytes(
            arch, batch * seq, dtype_bytes, sizes.token_tile
        ),
        f"activations of {kept - lean} layers ({chunk_tokens} tokens each"
        + (f", MLP in tiles of {sizes.token_tile})" if sizes.token_tile else ")"): whole,
        f"{lean} lean layers ({chunk_tokens} tokens each, weights too)": lean_kept,
        f"fp32 gradient sums over sequence chunks ({kept if chunked else 0} layers)": sum_bytes(arch, kept)
        if chunked
        else 0,
        f"activation checkpoints on the GPU ({on_gpu})": on_gpu * checkpoint_bytes(arch, batch * seq, dtype_bytes),
        "largest unit's weights and fp32 gradient": largest * (dtype_bytes + 4),
    }


def _loss_chunk(vocab: int, budget: int) -> int:
    tokens = 8192
    while tokens > 512 and tokens * vocab * LOSS_BYTES > budget / 8:
        tokens //= 2
    return tokens


def _keep(cfg: EngineConfig, auto: Sizes) -> Sizes:
    """Explicit config values win over the rule."""
    return Sizes(
        *(
            getattr(auto, f.name) if getattr(cfg, f.name) == "auto" else getattr(cfg, f.name)
            for f in dataclasses.fields(Sizes)
        )
    )


def apply(cfg: EngineConfig, sizes: Sizes) -> EngineConfig:
    return dataclasses.replace(cfg, **dataclasses.asdict(sizes))
