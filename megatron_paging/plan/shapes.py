"""Tensor shapes of one rank: parameter counts and, per layer and microbatch, the bytes autograd
keeps for backward and the working set of the layer's backward.

Pure Python (no torch, no Megatron): :mod:`megatron_paging.mcore.plan_inputs` fills
:class:`ModelShape`, :class:`Parallel` and the per-stage :class:`Chunk` lists from Megatron's own
flags and functions. Every byte count below names the tensors it is made of; they follow the
modules the example builds (Megatron-Core's local spec: torch norms, fused SDPA core attention,
unfused rope, ``bias_dropout_add``; megatron-paging's static dispatcher and
:class:`~megatron_paging.mcore.experts.PagedGroupedMLP`), bf16 activations.

Notation: ``T`` tokens of one microbatch on this rank (``seq x micro-batch / CP``), ``Ts`` the
same divided by TP under sequence parallelism (the residual stream), ``C`` the static expert
capacity rows (``ceil(T x topk x capacity factor)`` split in EP blocks), ``El`` local experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

BF16 = 2
FP32 = 4
# The softmax router and its load-balancing loss keep this many fp32 [tokens, experts] tensors
# per MoE layer (logits, scores, probs, routing map, aux-loss scores, top-k values and their
# compiled-kernel buffers), counted per layer in an allocator memory trace of the moe_compute
# frontier size (megatron_paging.tools.memory_trace).
ROUTER_FP32_TENSORS = 7
# The sigmoid router keeps two: the sigmoid's output for routing and for the aux loss (its probs
# are [tokens, top-k]); group-limited routing adds its bool expert mask. Counted in the peak's
# owners of DeepSeek-V3's last stage (benchmarks/results/scale_owners_h100.json).
SIGMOID_ROUTER_FP32_TENSORS = 2
# The unfused weighted activation (--no-bias-swiglu-fusion, Megatron-Core's torch expression)
# has at its backward's peak, per C x ffn element: dinter, silu(gate), the linear half plus its
# offset, silu*linear and inter in bf16 (5 x 2 B) and three fp32 temporaries (the gradient of
# the prob-weighted product, its product with the probs, the dprobs product: 3 x 4 B).
UNFUSED_ACT_BYTES = 5 * BF16 + 3 * FP32


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention sizes (``--q-lora-rank`` may be None: a plain query projection)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_dim: int
    v_head_dim: int
    # --recompute-modules mla_up_proj: the up projections and rope run again in backward, so
    # the query, key and value they make (SDPA's inputs) are not kept between the passes.
    recompute_up_proj: bool = False


@dataclass(frozen=True)
class ModelShape:
    """The model's sizes as Megatron's flags give them (vocab already padded)."""

    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int
    vocab: int
    seq: int
    micro_batch: int
    gated: bool = True
    untied: bool = True
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm
    qk_layernorm: bool = False
    hidden_dropout: bool = True  # dropout masks kept (1 byte per element)
    rotary_dim: int = 0  # rope channels per head (0: no rope)
    mla: MLAShape | None = None
    num_experts: int = 0
    topk: int = 0
    router_sigmoid: bool = False  # --moe-router-score-function sigmoid
    router_groups: int = 0  # --moe-router-num-groups (group-limited routing)
    moe_ffn: int = 0
    shared_ffn: int = 0
    capacity_factor: float | None = None
    fused_activation: bool = True  # Megatron's bias_swiglu_fusion
    param_bytes: int = BF16


@dataclass(frozen=True)
class Parallel:
    """The layout: world size and parallel sizes (DP follows Megatron's validate_args)."""

    world: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    grads_fp32: bool = True  # Megatron's accumulate_allreduce_grads_in_fp32 (bf16 sets it)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data parallel: world / (EP x PP x ETP), the group expert weights reduce over."""
        return self.world // (self.ep * self.pp * self.etp)


@dataclass(frozen=True)
class Layer:
    number: int  # Megatron's global layer number (1-based)
    moe: bool


@dataclass(frozen=True)
class Chunk:
    """What one model chunk (virtual stage) of this pipeline rank builds."""

    vp_stage: int
    layers: tuple[Layer, ...]
    embedding: bool = False
    loss: bool = False

    @property
    def moe_layers(self) -> int:
        return sum(layer.moe for layer in self.layers)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one rank, split as Megatron's optimizer groups them."""

    dense: int = 0  # 2-D dense weights (weight decay), reduced over the DP group
    dense_1d: int = 0  # norms (no weight decay)
    expert: int = 0  # routed-expert weights, reduced over the expert-DP group

    def __add__(self, other: ParamCounts) -> ParamCounts:
        return ParamCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def total(self) -> int:
        return self.dense + self.dense_1d + self.expert


@dataclass(frozen=True)
class Parts:
    """Activation bytes by part (what a layer or chunk keeps for backward)."""

    embedding_loss: int = 0
    attention: int = 0
    residual: int = 0  # norm outputs, the residual stream and its dropout masks
    dense_mlp: int = 0  # dense MLPs and shared experts
    router: int = 0
    dispatch: int = 0  # the static dispatcher's capacity-sized index maps and probs
    experts: int = 0  # expert activations on the device (capacity rows)

    def __add__(self, other: Parts) -> Parts:
        return Parts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: int) -> Parts:
        return Parts(*(getattr(self, f.name) * k for f in fields(self)))

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Dims:
    """Derived sizes every formula uses (one place for the divisions by TP, CP, EP)."""

    tokens: int  # T
    stream_tokens: int  # Ts
    heads: int  # per TP rank
    groups: int
    ffn: int  # dense MLP hidden per TP rank
    shared_ffn: int
    vocab: int  # per TP rank
    local_experts: int
    expert_ffn: int  # per expert-TP rank
    fc1_cols: int  # columns of the experts' fc1 output
    capacity: int  # C
    block: int  # rows per EP peer block
    expected_live: int  # tokens x topk routed to this rank on average


def token_counts(seq: int, micro_batch: int, par: Parallel) -> tuple[int, int]:
    """(tokens of a microbatch on this rank, tokens of its residual stream: split over TP
    under sequence parallelism), the latter what each MoE dispatch routes."""
    tokens = seq * micro_batch // par.cp
    return tokens, tokens // par.tp if par.sequence_parallel else tokens


def dims(model: ModelShape, par: Parallel) -> Dims:
    tokens, stream = token_counts(model.seq, model.micro_batch, par)
    moe_tokens = stream  # MoE with TP > 1 needs sequence parallelism: tokens arrive split
    expert_ffn = model.moe_ffn // par.etp
    routed = moe_tokens * model.topk
    if model.capacity_factor:
        budget = math.ceil(routed * model.capacity_factor)
        block = -(-budget // par.ep)
    else:  # no static budget: the dispatcher sizes to the routed rows (dropless average)
        block = -(-routed // par.ep)
    return Dims(
        tokens=tokens,
        stream_tokens=stream,
        heads=model.heads // par.tp,
        groups=max(1, model.query_groups // par.tp),
        ffn=model.ffn // par.tp,
        shared_ffn=model.shared_ffn // par.tp,
        vocab=model.vocab // par.tp,
        local_experts=model.num_experts // par.ep if model.num_experts else 0,
        expert_ffn=expert_ffn,
        fc1_cols=(2 if model.gated else 1) * expert_ffn,
        capacity=block * par.ep if model.num_experts else 0,
        block=block,
        expected_live=min(routed, block * par.ep) if model.num_experts else 0,
    )


# --- parameters ----------------------------------------------------------------------------


def _norm_params(model: ModelShape, width: int) -> int:
    return (2 if model.layernorm else 1) * width


def attention_params(model: ModelShape, par: Parallel) -> ParamCounts:
    h, d = model.hidden, model.kv_channels
    heads, groups = model.heads // par.tp, max(1, model.query_groups // par.tp)
    norm = _norm_params(model, h)
    if model.mla is None:
        qkv = h * (heads + 2 * groups) * d
        qk_norms = _norm_params(model, 2 * d) if model.qk_layernorm else 0
        return ParamCounts(qkv + heads * d * h, norm + qk_norms)
    m = model.mla
    qk = m.qk_head_dim + m.qk_pos_dim
    if m.q_lora_rank:
        q = h * m.q_lora_rank + m.q_lora_rank * heads * qk
        norm += m.q_lora_rank
    else:
        q = h * heads * qk
    kv_up = m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
    kv = h * (m.kv_lora_rank + m.qk_pos_dim) + kv_up
    norm += m.kv_lora_rank
    return ParamCounts(q + kv + heads * m.v_head_dim * h, norm)


def mlp_params(model: ModelShape, ffn_per_rank: int) -> int:
    return model.hidden * ffn_per_rank * (3 if model.gated else 2)


def layer_params(model: ModelShape, par: Parallel, layer: Layer) -> ParamCounts:
    counts = attention_params(model, par) + ParamCounts(0, _norm_params(model, model.hidden))
    if not layer.moe:
        return counts + ParamCounts(mlp_params(model, model.ffn // par.tp))
    d = dims(model, par)
    router = model.num_experts * model.hidden
    shared = mlp_params(model, d.shared_ffn) if model.shared_ffn else 0
    experts = d.local_experts * model.hidden * (d.fc1_cols + d.expert_ffn)
    return counts + ParamCounts(router + shared, 0, experts)


def chunk_params(model: ModelShape, par: Parallel, chunk: Chunk, last_stage: bool) -> ParamCounts:
    counts = ParamCounts()
    for layer in chunk.layers:
        counts += layer_params(model, par, layer)
    table = model.vocab // par.tp * model.hidden
    if chunk.embedding:
        counts += ParamCounts(table)
    if chunk.loss:
        counts += ParamCounts(0, _norm_params(model, model.hidden))
        # Untied: the output layer; tied with PP > 1: the last stage keeps a copy of the table.
        if model.untied or (last_stage and par.pp > 1 and not chunk.embedding):
            counts += ParamCounts(table)
    return counts


# --- activations kept for backward (per layer, per microbatch) ----------------------------


def attention_saved(model: ModelShape, d: Dims) -> int:
    """Self-attention internals: projections' outputs that rope and SDPA keep, SDPA's output
    and log-sum-exp (flash/efficient: no [s, s] tensor)."""
    t, n = d.tokens, d.heads
    if model.mla is None:
        g, hd = d.groups, model.kv_channels
        qkv = BF16 * t * (n + 2 * g) * hd  # the fused qkv output: value is a view into it
        # rope's (or, without rope, the qk norms') new q and k
        new_qk = BF16 * t * (n + g) * hd if model.rotary_dim or model.qk_layernorm else 0
        return (qkv + new_qk + rope_saved(model, d) + qk_norms_saved(model, d)
                + BF16 * t * n * hd + FP32 * t * n)
    m = model.mla
    # the down projections' outputs (the up projections' inputs) and, with --qk-layernorm,
    # their norms' outputs (without it the local spec builds the norms as identities)
    norms = 2 if model.qk_layernorm else 1
    q_lora = norms * BF16 * t * m.q_lora_rank if m.q_lora_rank else 0
    kv_lora = BF16 * t * (m.kv_lora_rank + m.qk_pos_dim) + (norms - 1) * BF16 * t * m.kv_lora_rank
    # the up projections' work: query, key (rope concatenated), value, and rope's cos/sin
    up_proj = 0 if m.recompute_up_proj else mla_up_proj_saved(m, d)
    return q_lora + kv_lora + up_proj + rope_saved(model, d) + BF16 * t * n * m.v_head_dim \
        + FP32 * t * n


def rope_saved(model: ModelShape, d: Dims) -> int:
    """Rope's cos and sin, kept for its backward (none with MLA's up projections recomputed:
    rope runs inside that recompute). MLA applies rope twice (query, key), each call making its
    own cos and sin."""
    if model.mla is not None:
        return 0 if model.mla.recompute_up_proj else 4 * BF16 * d.tokens * model.mla.qk_pos_dim
    return 2 * BF16 * d.tokens * model.rotary_dim


def mla_up_proj_saved(m: MLAShape, d: Dims) -> int:
    """Query, key (rope concatenated) and value of one MLA layer: what SDPA keeps, and what
    ``mla_up_proj`` recompute makes again in backward."""
    return BF16 * d.tokens * d.heads * (2 * (m.qk_head_dim + m.qk_pos_dim) + m.v_head_dim)


def qk_norms_saved(model: ModelShape, d: Dims) -> int:
    """``--qk-layernorm``: the query and key norms keep their inputs and fp32 rstd per head row.
    Key's input is a view into the qkv output; query's is a copy whenever there are several
    groups of several queries (its reshape cannot view qkv's group-interleaved layout)."""
    if not model.qk_layernorm or model.mla is not None:
        return 0
    t, n, g = d.tokens, d.heads, d.groups
    query_copy = BF16 * t * n * model.kv_channels if g > 1 and n > g else 0
    return query_copy + FP32 * t * (n + g)


def residual_saved(model: ModelShape, d: Dims) -> int:
    """Two norm outputs (the projections' inputs), two residual-stream tensors (the next norms'
    inputs) and, with hidden dropout, two bool masks; plus the norms' fp32 rstd."""
    ts, h = d.stream_tokens, model.hidden
    masks = 2 * ts * h if model.hidden_dropout else 0
    return 4 * BF16 * ts * h + masks + 2 * FP32 * ts


def mlp_saved(model: ModelShape, d: Dims, ffn: int) -> int:
    """A dense MLP or the shared experts: fc1's output (kept by the activation) and the
    activation's output (kept by fc2); their input is the norm output counted in residual."""
    return BF16 * d.tokens * ffn * ((2 if model.gated else 1) + 1)


def router_saved(model: ModelShape, d: Dims) -> int:
    scores = d.stream_tokens * model.num_experts
    if model.router_sigmoid:
        return SIGMOID_ROUTER_FP32_TENSORS * FP32 * scores + (scores if model.router_groups else 0)
    return ROUTER_FP32_TENSORS * FP32 * scores


def dispatch_saved(model: ModelShape, d: Dims) -> int:
    """The static dispatcher's gathers keep int64 row maps and bool masks: three of capacity
    rows (regroup, combine, send; 9 B a row), the combine map per route (token row, mask,
    expert: 17 B per token x topk); the experts keep the dispatched probs (fp32 per row)."""
    return 27 * d.capacity + 17 * d.stream_tokens * model.topk + FP32 * d.capacity


def dispatch_working_set(model: ModelShape, d: Dims) -> int:
    """The static dispatcher's regroup gather: in backward the experts' input gradient, the
    rows it gathers and their masked copy; in forward's combine the experts' output, the rows
    and their copy (all [C, h])."""
    return 3 * BF16 * d.capacity * model.hidden


def expert_bytes(model: ModelShape, d: Dims, rows: int, recompute_fc1: bool) -> int:
    """What the experts save for ``rows`` rows: x (and fc1 unless recomputed)."""
    cols = model.hidden + (0 if recompute_fc1 else d.fc1_cols)
    return BF16 * rows * cols


def embedding_saved(model: ModelShape, d: Dims) -> int:
    """The embedding's output (the first norm's input) and its dropout mask."""
    ts, h = d.stream_tokens, model.hidden
    return BF16 * ts * h + (ts * h if model.hidden_dropout else 0)


def loss_saved(model: ModelShape, d: Dims) -> int:
    """The final norm's output (the output layer's input) and the cross entropy's fp32 softmax
    (Megatron's vocab-parallel cross entropy keeps it for backward)."""
    return BF16 * d.stream_tokens * model.hidden + FP32 * d.tokens * d.vocab


def loss_working_set(model: ModelShape, d: Dims) -> int:
    """Beyond the saved softmax: the bf16 logits while the fp32 copy is made (forward) and the
    bf16 logits gradient cast from it (backward), both tokens x vocab."""
    return BF16 * d.tokens * d.vocab


# --- backward working sets (beyond the layer's saved tensors) ------------------------------


def attention_working_set(model: ModelShape, d: Dims) -> int:
    """SDPA's backward: the output gradient, dq, dk, dv, and the projection-input gradient
    they are assembled into."""
    t, n = d.tokens, d.heads
    if model.mla is None:
        hd, g = model.kv_channels, d.groups
        return BF16 * t * (n * hd + 2 * (n + 2 * g) * hd)
    m = model.mla
    qk = m.qk_head_dim + m.qk_pos_dim
    grads = BF16 * t * n * (m.v_head_dim + 2 * qk + m.v_head_dim)
    recomputed = mla_up_proj_saved(m, d) if m.recompute_up_proj else 0  # made again here
    return grads + BF16 * t * n * (m.qk_head_dim + m.v_head_dim) + recomputed


def mlp_working_set(model: ModelShape, d: Dims, ffn: int) -> int:
    """A dense MLP's backward: the larger of fc2's (output gradient, activation gradient, fc2
    weight gradient), the activation's (+ fc1-output gradient) and fc1's (+ input gradient,
    fc1 weight gradient) moments."""
    t, ts, h = d.tokens, d.stream_tokens, model.hidden
    c1 = (2 if model.gated else 1) * ffn
    dout, dact, dfc1 = BF16 * ts * h, BF16 * t * ffn, BF16 * t * c1
    fc2_moment = dout + dact + BF16 * h * ffn
    fc1_moment = dfc1 + BF16 * ts * h + BF16 * h * c1
    return max(fc2_moment, dout + dact + dfc1, fc1_moment)


def expert_working_set(model: ModelShape, d: Dims, recompute_fc1: bool) -> int:
    """The routed experts' backward (PagedGroupedMLP), the larger of two moments:

    * fc2's weight gradient: the output gradient ``dout`` [C, h], ``inter`` [C, ffn] (the
      fused activation writes it over ``dinter``), ``dfc1`` [C, fc1] and ``dw2``; with the fc1
      recompute, fc1 is recomputed here (``dfc1`` written over it) instead of being saved;
    * fc1's gradients: ``dfc1``, ``dx`` [C, h] and ``dw1`` (+ ``dout`` and ``dw2``, still held
      by the fc1-recompute function).

    Unfused (``--no-bias-swiglu-fusion``) the activation's backward peaks at
    :data:`UNFUSED_ACT_BYTES` per C x ffn element over ``dout``.
    """
    c, h, f, c1 = d.capacity, model.hidden, d.expert_ffn, d.fc1_cols
    el = d.local_experts
    dout, dx, dfc1, inter = BF16 * c * h, BF16 * c * h, BF16 * c * c1, BF16 * c * f
    dw1, dw2 = BF16 * el * h * c1, BF16 * el * h * f
    fc2_moment = dout + inter + dfc1 + dw2
    fc1_moment = dfc1 + dx + dw1 + ((dout + dw2) if recompute_fc1 else 0)
    moments = [fc2_moment, fc1_moment]
    if not model.fused_activation:
        moments.append(dout + UNFUSED_ACT_BYTES * c * f + (dfc1 if recompute_fc1 else 0))
    return max(moments)


__all__ = [
    "BF16", "FP32", "Chunk", "Dims", "Layer", "MLAShape", "ModelShape", "Parallel",
    "ParamCounts", "Parts", "ROUTER_FP32_TENSORS", "SIGMOID_ROUTER_FP32_TENSORS",
    "UNFUSED_ACT_BYTES", "dims",
]
