"""The start-up refusals behind :func:`megatron_paging.mcore.flags.paging_config`: Megatron flag
combinations that paging (or our TE-free spec) cannot serve, each one ``ValueError`` naming the
flags, raised before any model is built."""

from __future__ import annotations

import math

from megatron_paging.mcore.dispatcher import STATIC_BACKEND
from megatron_paging.mcore.offload import EXPERT_MODULES

CORE_ATTENTION_DEFAULT = "sdpa"
SDPA_BACKEND_DEFAULT = "auto"
# Megatron's CUDA-graph modes that cannot capture paging (full_iteration can).
UNSUPPORTED_GRAPH_IMPLS = ("local", "transformer_engine")
# Selective-recompute modules that Megatron-Core 0.19.2 wraps in
# tensor_parallel.CheckpointWithoutOutput() with its default fp8=False, which it stores as
# ``fp8 is not None`` (True) and so calls TE's FP8GlobalStateManager, a NameError without TE:
# layernorm (transformer_layer.py, fine_grained_callables.py), moe_act (TEGroupedMLP, the only
# expert module that implements it) and gdn_norm_out (gated delta net). mla_up_proj passes
# fp8=config.fp8 or config.fp4, None without fp8, and gets through.
TE_RECOMPUTE_MODULES = ("layernorm", "moe_act", "gdn_norm_out")


def pool_residency(args) -> str:
    """``auto``: free the pages between eager steps; keep them when a graph captures the step."""
    residency = getattr(args, "paging_pool_residency", "auto")
    graphed = getattr(args, "cuda_graph_impl", "none") == "full_iteration"
    if residency == "step" and graphed:
        raise ValueError(
            "--paging-pool-residency step cannot be combined with --cuda-graph-impl "
            "full_iteration (the captured graph holds the pages' addresses); use persistent "
            "or auto"
        )
    if residency == "auto":
        return "persistent" if graphed else "step"
    return residency


def check_core_attention(args) -> None:
    core = getattr(args, "paging_core_attention", CORE_ATTENTION_DEFAULT)
    sdpa = getattr(args, "paging_sdpa_backend", SDPA_BACKEND_DEFAULT)
    if core != "sdpa" and sdpa != SDPA_BACKEND_DEFAULT:
        raise ValueError(f"--paging-sdpa-backend {sdpa} needs --paging-core-attention sdpa")
    if core == "sdpa" and sdpa == "cudnn" and getattr(args, "deterministic_mode", False):
        raise ValueError(
            "--paging-sdpa-backend cudnn is not deterministic (PyTorch excludes cuDNN attention "
            "under --deterministic-mode); use auto or flash"
        )


def check_recompute_modules(args, te_available: bool) -> None:
    """Refused at start-up rather than as a NameError in the first forward (paged or not: the
    example builds every model, the unpaged control's too, from a TE-free spec)."""
    if te_available or getattr(args, "recompute_granularity", None) != "selective":
        return
    modules = getattr(args, "recompute_modules", None) or []
    needs_te = [m for m in modules if m in TE_RECOMPUTE_MODULES]
    if needs_te:
        raise ValueError(
            f"--recompute-modules {' '.join(needs_te)} needs Transformer Engine: Megatron-Core "
            "0.19.2's CheckpointWithoutOutput calls TE's FP8GlobalStateManager even without fp8; "
            "recompute core_attn, mlp or moe instead"
        )


def check_megatron_combinations(args) -> None:
    """Megatron features that cannot run with paging, refused by name."""
    rank_factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    if rank_factor is None:
        raise ValueError(
            "--moe-paged-stash needs --moe-expert-rank-capacity-factor (the static expert "
            "capacity that paging shrinks to live rows)"
        )
    if (
        isinstance(rank_factor, bool)
        or not isinstance(rank_factor, (int, float))
        or not math.isfinite(rank_factor)
        or rank_factor <= 0
    ):
        raise ValueError(f"--moe-expert-rank-capacity-factor must be > 0, got {rank_factor}")
    # A recompute whose forward covers every MoE layer saves no expert activation to page
    # (the recomputed forward runs inside the backward, where paging stays off). Partial
    # recompute (--recompute-method block) pages the layers it does not recompute.
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "paging_implementation", "ours") == "mcore":
        granularity = None  # Megatron-Core's own manager: its behaviour, not ours to refuse
    if granularity == "selective" and "moe" in (getattr(args, "recompute_modules", None) or []):
        raise ValueError(
            "--moe-paged-stash with --recompute-granularity selective --recompute-modules moe "
            "pages nothing (every MoE layer is recomputed in the backward); drop one of them"
        )
    if granularity == "full" and getattr(args, "recompute_method", None) == "uniform":
        raise ValueError(
            "--moe-paged-stash with --recompute-granularity full --recompute-method uniform "
            "pages nothing (every layer is recomputed in the backward); use --recompute-method "
            "block to recompute some layers and page the others"
        )
    graph_impl = getattr(args, "cuda_graph_impl", "none")
    if graph_impl in UNSUPPORTED_GRAPH_IMPLS:
        raise ValueError(
            f"--cuda-graph-impl {graph_impl} cannot be combined with --moe-paged-stash "
            "(per-layer graphs capture an expert forward apart from the backward that reloads "
            "it); use --cuda-graph-impl full_iteration"
        )


def check_prefetch_point(args) -> None:
    """``--paging-prefetch-point dispatcher`` marks the input of our static dispatcher: any
    other dispatcher would never report the layer's backward end there."""
    if getattr(args, "paging_prefetch_point", "experts") != "dispatcher":
        return
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if dispatcher != "flex" or backend != STATIC_BACKEND:
        raise ValueError(
            "--paging-prefetch-point dispatcher needs --moe-token-dispatcher-type flex "
            f"--moe-flex-dispatcher-backend {STATIC_BACKEND} (got {dispatcher!r} / {backend!r})"
        )


def check_recompute_expert_fc1(args) -> None:
    """``--paging-recompute-expert-fc1``: the experts then save no fc1 for ``moe_act``; its
    piece size needs it and is a non-negative row count."""
    pieces = getattr(args, "paging_recompute_expert_fc1_piece_rows", 0)
    if pieces is not None and pieces < 0:
        raise ValueError(
            f"--paging-recompute-expert-fc1-piece-rows must be >= 0 (0: whole), got {pieces}"
        )
    if not getattr(args, "paging_recompute_expert_fc1", False):
        if pieces:
            raise ValueError(
                "--paging-recompute-expert-fc1-piece-rows only applies with "
                "--paging-recompute-expert-fc1"
            )
        return
    if pieces and getattr(args, "swiglu", False) and getattr(args, "bias_swiglu_fusion", False):
        raise ValueError(
            "--paging-recompute-expert-fc1-piece-rows pieces the unfused activation's fp32 "
            "temporaries, which the fused SwiGLU (Megatron's default bias_swiglu_fusion) "
            "does not make: add --no-bias-swiglu-fusion or drop the piece rows"
        )
    modules = getattr(args, "offload_modules", None) or []
    if getattr(args, "fine_grained_activation_offloading", False) and "moe_act" in modules:
        raise ValueError(
            "--offload-modules moe_act offloads the experts' fc1, which "
            "--paging-recompute-expert-fc1 does not keep; drop moe_act (expert_fc1 offloads the "
            "experts' input, all they save)"
        )


def check_offload(args) -> None:
    """``--paging-offload-backend paged``: what it needs and what it cannot serve."""
    if not getattr(args, "fine_grained_activation_offloading", False):
        raise ValueError(
            "--paging-offload-backend paged needs --fine-grained-activation-offloading "
            "--offload-modules ..."
        )
    if getattr(args, "paging_implementation", "ours") == "mcore":
        raise ValueError(
            "--paging-offload-backend paged runs on megatron-paging's runtime; it cannot be "
            "combined with --paging-implementation mcore"
        )
    modules = set(getattr(args, "offload_modules", None) or [])
    experts = sorted(modules & set(EXPERT_MODULES))
    if experts and getattr(args, "moe_expert_rank_capacity_factor", None) is None:
        # Live rows fill a host tier sized at calibration; only the step runner that comes with
        # a static capacity reads its overflow flag before the optimizer step.
        raise ValueError(
            f"--offload-modules {' '.join(experts)} with --paging-offload-backend paged needs "
            "--moe-expert-rank-capacity-factor (static expert capacity; its step runner checks "
            "the host tier's overflow flag)"
        )
    if "fused_group_mlp" in modules:
        raise ValueError(
            "--offload-modules fused_group_mlp needs Transformer Engine's op fuser; with "
            "--paging-offload-backend paged offload expert_fc1 and moe_act instead"
        )
    graph_impl = getattr(args, "cuda_graph_impl", "none")
    if graph_impl in UNSUPPORTED_GRAPH_IMPLS:
        raise ValueError(
            f"--cuda-graph-impl {graph_impl} cannot be combined with --paging-offload-backend "
            "paged (per-layer graphs split a group's offload from its reload); use "
            "--cuda-graph-impl full_iteration"
        )
    if getattr(args, "delay_offload_until_cuda_graph", False):
        raise ValueError(
            "--delay-offload-until-cuda-graph has no effect with --paging-offload-backend paged "
            "(offloads run on the paging stream, which the compute stream waits on only where "
            "it reads a reloaded tensor)"
        )
    in_flight = getattr(args, "fine_grained_offloading_max_inflight_offloads", None)
    if in_flight is not None and graph_impl != "full_iteration":
        raise ValueError(
            "--fine-grained-offloading-max-inflight-offloads applies to --paging-offload-backend "
            "paged only with --cuda-graph-impl full_iteration (eagerly the compute stream never "
            "waits on an offload)"
        )


__all__ = [
    "CORE_ATTENTION_DEFAULT",
    "SDPA_BACKEND_DEFAULT",
    "TE_RECOMPUTE_MODULES",
    "UNSUPPORTED_GRAPH_IMPLS",
    "check_core_attention",
    "check_megatron_combinations",
    "check_offload",
    "check_prefetch_point",
    "check_recompute_expert_fc1",
    "check_recompute_modules",
    "pool_residency",
]
