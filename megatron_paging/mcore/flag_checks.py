"""The start-up refusals behind :func:`megatron_paging.mcore.flags.paging_config`: Megatron flag
combinations that paging (or our TE-free spec) cannot serve, each one ``ValueError`` naming the
flags, raised before any model is built."""

from __future__ import annotations

import math

from megatron_paging.mcore.offloading.backend import DENSE_MODULES, EXPERT_MODULES

# Megatron's CUDA-graph modes that cannot capture paging (full_iteration can).
UNSUPPORTED_GRAPH_IMPLS = ("local", "transformer_engine")
# Selective-recompute modules that Megatron-Core 0.19.2 wraps in
# tensor_parallel.CheckpointWithoutOutput() with its default fp8=False, which it stores as
# ``fp8 is not None`` (True) and so calls TE's FP8GlobalStateManager, a NameError without TE:
# layernorm (transformer_layer.py, fine_grained_callables.py), moe_act (TEGroupedMLP, the only
# expert module that implements it) and gdn_norm_out (gated delta net). mla_up_proj passes
# fp8=config.fp8 or config.fp4, None without fp8, and gets through.
TE_RECOMPUTE_MODULES = ("layernorm", "moe_act", "gdn_norm_out")


def pool_residency(graphed: bool) -> str:
    """Free the pages between eager steps (the optimizer step gets their memory); keep them when
    a full-iteration CUDA graph captures the step (the graph holds their addresses)."""
    return "persistent" if graphed else "step"


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


def check_megatron_combinations(args, refuse_recompute: bool = True) -> None:
    """Megatron features that cannot run with paging, refused by name (``refuse_recompute``:
    a recompute of every MoE layer, which leaves our engine nothing to page)."""
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
    granularity = getattr(args, "recompute_granularity", None) if refuse_recompute else None
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
    if granularity == "full" and getattr(args, "recompute_method", None) == "block":
        chunks = (getattr(args, "pipeline_model_parallel_size", 1) or 1) * (
            getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
        layers_per_chunk = -(-(getattr(args, "num_layers", 0) or 0) // chunks)
        recomputed = getattr(args, "recompute_num_layers", None) or 0
        if layers_per_chunk and recomputed >= layers_per_chunk:
            raise ValueError(
                f"--moe-paged-stash with --recompute-method block --recompute-num-layers "
                f"{recomputed} pages nothing (each pipeline chunk holds {layers_per_chunk} "
                "layers, all recomputed in the backward); recompute fewer layers"
            )
    policy = getattr(args, "paging_overflow_policy", "rerun")
    if policy in ("skip", "grow"):
        # both drop an overflowed step's update on the device (overflow/optimizer_skip.py)
        if getattr(args, "optimizer_cuda_graph", False):
            raise ValueError(
                f"--optimizer-cuda-graph with --paging-overflow-policy {policy}: the captured "
                "optimizer step would read the skip flag of the step it was captured in; use "
                "--paging-overflow-policy rerun"
            )
        if getattr(args, "fp16", False):
            raise ValueError(
                f"--fp16 with --paging-overflow-policy {policy}: a dropped step's gradients "
                "still reach Megatron's loss scaler, which backs off on them; use "
                "--paging-overflow-policy rerun or --bf16"
            )
    if getattr(args, "rampup_batch_size", None):
        # its init_num_microbatches_calculator no longer passes the ramp on (deprecated)
        raise ValueError(
            "--rampup-batch-size: Megatron-Core 0.19.2 parses it but never ramps (every step "
            "runs the full --global-batch-size); use --step-batch-size-schedule"
        )
    graph_impl = getattr(args, "cuda_graph_impl", "none")
    if graph_impl == "full_iteration" and getattr(args, "step_batch_size_schedule", None):
        # FullCudaGraphWrapper captures once and replays that step's microbatch count
        raise ValueError(
            "--step-batch-size-schedule with --cuda-graph-impl full_iteration: Megatron-Core "
            "0.19.2 replays the graph captured at the first step's microbatch count for every "
            "later count (the added microbatches never train); drop one of them"
        )
    if graph_impl in UNSUPPORTED_GRAPH_IMPLS:
        raise ValueError(
            f"--cuda-graph-impl {graph_impl} cannot be combined with --moe-paged-stash "
            "(per-layer graphs capture an expert forward apart from the backward that reloads "
            "it); use --cuda-graph-impl full_iteration"
        )


def check_recompute_expert_fc1(args) -> None:
    """``--paging-recompute-expert-fc1``: the experts then save no fc1 for ``moe_act``."""
    if not getattr(args, "paging_recompute_expert_fc1", False):
        return
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


def check_offload_modules(args, te_available: bool) -> None:
    """``--offload-modules`` against what the chosen backend can offload, one line each, before
    Megatron-Core's assertions in ``TransformerConfig`` would end the run in a traceback."""
    if not getattr(args, "fine_grained_activation_offloading", False):
        return
    paged = getattr(args, "paging_offload_backend", "mcore") == "paged"
    allowed = (*DENSE_MODULES, *EXPERT_MODULES)
    if not paged:
        allowed = (*allowed, "fused_group_mlp")  # with Transformer Engine's op fuser
    modules = list(getattr(args, "offload_modules", None) or [])
    if not modules:
        raise ValueError(
            "--fine-grained-activation-offloading needs --offload-modules (one or more of "
            f"{', '.join(allowed)})"
        )
    unknown = [m for m in modules if m not in allowed]
    if unknown:
        backend = "paged" if paged else "mcore"
        raise ValueError(
            f"--offload-modules {' '.join(unknown)}: not offloadable with "
            f"--paging-offload-backend {backend}; choose from {', '.join(allowed)}"
        )
    experts = [m for m in modules if m in (*EXPERT_MODULES, "fused_group_mlp")]
    if experts and not paged and getattr(args, "moe_paged_stash", False):
        raise ValueError(
            f"--offload-modules {' '.join(experts)} with --moe-paged-stash needs "
            "--paging-offload-backend paged (Megatron-Core's offloading cannot move what the "
            "paged stash holds)"
        )
    if "fused_group_mlp" in modules and not te_available:
        raise ValueError(
            "--offload-modules fused_group_mlp needs Transformer Engine's op fuser (not "
            "installed); offload expert_fc1 and moe_act instead"
        )
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ValueError(
            "--offload-modules attn_proj needs core_attn too (attn_proj's input is core_attn's "
            "output, which core_attn's backward reads)"
        )


def check_delay_wgrad(args) -> None:
    """Megatron-Core 0.19.2 defers weight gradients only inside Transformer Engine's grouped GEMM;
    our TE-free experts compute them in the backward, so the flag would be silently ignored."""
    if getattr(args, "delay_wgrad_compute", False):
        raise ValueError(
            "--delay-wgrad-compute needs Transformer Engine's grouped GEMM in Megatron-Core "
            "0.19.2; megatron-paging's experts compute weight gradients in the backward"
        )


# Flex-dispatcher options the static backend has no use for: it permutes by its own gathers.
STATIC_NO_EFFECT = ("moe_permute_fusion", "moe_permute_fusion_into_hybridep")


def check_static_backend(args) -> None:
    """``--moe-flex-dispatcher-backend static``: what would be silently ignored, or would swap the
    backend for another (Megatron-Core turns ``--moe-enable-deepep`` into the deepep backend)."""
    if getattr(args, "moe_enable_deepep", False):
        raise ValueError(
            "--moe-enable-deepep replaces --moe-flex-dispatcher-backend static by deepep; drop "
            "one of them"
        )
    for dest in STATIC_NO_EFFECT:
        if getattr(args, dest, False):
            raise ValueError(
                f"--{dest.replace('_', '-')} has no effect with --moe-flex-dispatcher-backend "
                "static (it permutes by its own gathers); drop the flag"
            )


def check_fake_process_group(args) -> None:
    """``--fake-process-group``: one rank of a larger job, its peers emulated at the static
    dispatcher's exchanges and the pipeline receives (docs/scale.md); what else would read
    collectives the fake group leaves unwritten is refused."""
    from megatron_paging.tools.peer_load import parse_load

    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if getattr(args, "num_experts", None) and (dispatcher != "flex" or backend != "static"):
        raise ValueError(
            "--fake-process-group needs --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend static: megatron-paging emulates the EP exchange of "
            f"that backend only (got {dispatcher} / {backend}); other dispatchers size their "
            "buffers from counts a fake group leaves unwritten"
        )
    if getattr(args, "cuda_graph_impl", "none") != "none":
        raise ValueError(
            f"--cuda-graph-impl {args.cuda_graph_impl} cannot be combined with "
            "--fake-process-group (the emulated peers run host code at every exchange)"
        )
    for flag in ("save", "load"):
        if getattr(args, flag, None):
            # the checkpoint's metadata is gathered over the whole (fake) world: nothing fills it
            raise ValueError(
                f"--{flag} cannot be combined with --fake-process-group: an emulated rank's "
                "peers hold no state, so no job checkpoint can be written or read"
            )
    try:
        load = parse_load(getattr(args, "paging_emulated_load", "lognormal:0.3"))
        shape = _route_shape(args) if hasattr(load, "check") else None
        if shape is not None:
            load.check(shape)  # a trace recorded for another layout: here, not after the build
    except ValueError as error:
        raise ValueError(f"--paging-emulated-load {error}") from None


def _route_shape(args):
    """The peers' route shape of a validated line (Megatron set its world size, rank and DP
    size), else None: the peers check a trace again at their first exchange."""
    from megatron_paging.mcore.grid import route_shape

    rank = getattr(args, "rank", None)
    if rank is None or not getattr(args, "data_parallel_size", None):
        return None
    return route_shape(args, rank)


__all__ = [
    "TE_RECOMPUTE_MODULES",
    "UNSUPPORTED_GRAPH_IMPLS",
    "check_delay_wgrad",
    "check_fake_process_group",
    "check_megatron_combinations",
    "check_offload",
    "check_offload_modules",
    "check_recompute_expert_fc1",
    "check_recompute_modules",
    "check_static_backend",
    "pool_residency",
]
