"""A Megatron launch line -> :class:`~megatron_paging.plan.model.PlanInputs`: what the plan
(pure Python, :mod:`megatron_paging.plan`) needs of Megatron.

Nothing here re-derives what Megatron decides: the flags go through Megatron's own
``parse_args(extra_args_provider=add_paging_args)`` and ``validate_args`` (world size and rank
from ``WORLD_SIZE``/``RANK``, set in-process; the argument dump it prints is dropped; under
``--fake-process-group`` with the static dispatcher, through the same validation lift the
emulated-rank example uses), the paging flags through
:func:`~megatron_paging.mcore.flags.paging_config`; which layers a stage builds, and which are MoE,
through ``get_num_layers_to_build``, ``get_transformer_layer_offset`` (a
``--pipeline-model-parallel-layout`` as ``PipelineParallelLayerLayout``), ``get_moe_layer_pattern``
and ``is_pipeline_first_stage`` / ``is_pipeline_last_stage``; the ranks of a stage through
``RankGenerator``; each stage's op order through Megatron-Core's schedule generators
(:mod:`megatron_paging.mcore.op_order`). Every error is one line naming the flag.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
from types import SimpleNamespace

from megatron_paging.env import quiet_megatron_import
from megatron_paging.mcore.grid import parallel, rank_positions
from megatron_paging.plan import shapes as S
from megatron_paging.plan.arms import PagingSettings
from megatron_paging.plan.model import PlanInputs, StageInputs

IMPLEMENTATION_ENV = "MEGATRON_PAGING_BENCH_IMPLEMENTATION"  # examples/preflight.py's control
EXPERT_OFFLOAD = {"expert_fc1", "moe_act"}
MODELED_RECOMPUTE = {"moe", "core_attn", "mla_up_proj"}


# What the plan needs of a launch line (Megatron requires some; its refusal of a missing one is
# a bare AssertionError, and the rest the plan reads).
REQUIRED_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                  "--max-position-embeddings", "--num-experts", "--vocab-size")
EXAMPLE = "$(DRY_RUN=1 bash examples/run_pretrain_1gpu.sh)"


class PlanError(ValueError):
    """One line: what in the launch line the plan cannot use, naming the flag."""


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def check_required(args) -> None:
    """The launch line names every flag of :data:`REQUIRED_FLAGS`, and is an MoE model."""
    missing = [flag for flag in REQUIRED_FLAGS
               if flag != "--num-experts" and getattr(args, _dest(flag), None) is None]
    if missing:
        raise PlanError(f"the launch line lacks {', '.join(missing)}; usage: megatron-paging "
                        f"plan [OPTIONS] MEGATRON_FLAGS, with at least {' '.join(REQUIRED_FLAGS)}"
                        f" (e.g. megatron-paging plan {EXAMPLE})")
    if not args.num_experts:
        raise PlanError("no --num-experts: a dense model has no expert activations, so every "
                        "arm would be the same; the plan compares ways to hold an MoE's")


@contextlib.contextmanager
def _environment(world_size: int | None, rank: int | None, argv: list[str]):
    """WORLD_SIZE / RANK / sys.argv as Megatron's parser reads them. Afterwards the process is as
    it was: Megatron's validation of ``--deterministic-mode`` also sets environment variables
    and torch's deterministic-algorithms mode, which planning a line must not leave behind."""
    import torch

    saved_env, saved_argv = dict(os.environ), sys.argv
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    if world_size is not None:
        os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = str(rank if rank is not None else 0)
    sys.argv = ["megatron-paging plan", *argv]
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def parse_megatron(argv: list[str], world_size: int | None = None, rank: int | None = None):
    """Megatron's parsed and validated ``args`` for ``argv``; PlanError (one line) otherwise."""
    with quiet_megatron_import():
        from megatron.training import arguments

        from megatron_paging.mcore.flags import add_paging_args, paging_config
        from megatron_paging.mcore.validation import validate

    err = io.StringIO()
    with _environment(world_size, rank, argv):
        try:
            with contextlib.redirect_stderr(err):
                args = arguments.parse_args(extra_args_provider=add_paging_args)
        except SystemExit:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            message = lines[-1].split("error: ", 1)[-1] if lines else "bad arguments"
            raise PlanError(message) from None
        check_required(args)
        try:
            validate(args)
        except ValueError as error:
            raise PlanError(str(error)) from None
    try:
        paging_config(args, environ={}, cuda_available=True,
                      te_available=importlib.util.find_spec("transformer_engine") is not None)
    except ValueError as error:
        raise PlanError(str(error)) from None
    _refuse_unmodeled(args)
    return args


def _refuse_unmodeled(args) -> None:
    if getattr(args, "fp8", None) or getattr(args, "fp4", None):
        raise PlanError("--fp8-format/--fp4-format: the plan models bf16/fp16/fp32 activations")
    if getattr(args, "mtp_num_layers", None):
        raise PlanError("--mtp-num-layers: the plan does not model multi-token prediction layers")
    if args.recompute_granularity == "full":
        raise PlanError("--recompute-granularity full: the plan models selective recompute of "
                        "moe (the recompute arm) only")
    other = set(args.recompute_modules or []) - MODELED_RECOMPUTE
    if args.recompute_granularity == "selective" and other:
        raise PlanError(f"--recompute-modules {' '.join(sorted(other))}: the plan models moe, "
                        "mla_up_proj (and core_attn, which saves nothing a fused attention "
                        "keeps)")
    if not args.vocab_size:
        raise PlanError("--vocab-size is needed (the plan builds no tokenizer)")


def model_shape(args) -> S.ModelShape:
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    heads = args.num_attention_heads
    mla = None
    if args.multi_latent_attention:
        up_proj = (args.recompute_granularity == "selective"
                   and "mla_up_proj" in (args.recompute_modules or []))
        mla = S.MLAShape(args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
                         args.qk_pos_emb_head_dim, args.v_head_dim, recompute_up_proj=up_proj)
    rope = args.position_embedding_type == "rope" and mla is None
    vocab = args.padded_vocab_size or vocab_size_with_padding(args.vocab_size, args, False)
    dtype = str(args.params_dtype)
    return S.ModelShape(
        hidden=args.hidden_size, heads=heads,
        query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels, ffn=args.ffn_hidden_size, vocab=vocab,
        seq=args.seq_length, micro_batch=args.micro_batch_size, gated=bool(args.swiglu),
        untied=bool(args.untie_embeddings_and_output_weights),
        layernorm=args.normalization == "LayerNorm", qk_layernorm=bool(args.qk_layernorm),
        hidden_dropout=args.hidden_dropout > 0,
        rotary_dim=int(args.kv_channels * args.rotary_percent) if rope else 0, mla=mla,
        num_experts=args.num_experts or 0, topk=args.moe_router_topk or 0,
        router_sigmoid=args.moe_router_score_function == "sigmoid",
        router_groups=args.moe_router_num_groups or 0,
        moe_ffn=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        shared_ffn=args.moe_shared_expert_intermediate_size or 0,
        capacity_factor=args.moe_expert_rank_capacity_factor,
        fused_activation=bool(args.bias_swiglu_fusion),
        param_bytes=S.FP32 if "float32" in dtype else S.BF16,
    )


@contextlib.contextmanager
def quiet():
    """Megatron's import-time warnings and INFO logs (the layout it parsed, the rank it could not
    find) are not the plan's output."""
    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with quiet_megatron_import():
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _pipeline_rank(pp: int, vpp: int | None, rank: int):
    """Megatron-Core's parallel_state answering as pipeline rank ``rank`` (no process group)."""
    from megatron.core import parallel_state as ps

    saved = (ps._MPU_PIPELINE_MODEL_PARALLEL_RANK, ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
             ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    ps.set_pipeline_model_parallel_rank(rank)
    ps.set_pipeline_model_parallel_world_size(pp)
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        yield ps
    finally:
        ps.set_pipeline_model_parallel_rank(saved[0])
        ps.set_pipeline_model_parallel_world_size(saved[1])
        ps.set_virtual_pipeline_model_parallel_world_size(saved[2])


def stage_chunks(args, pp_rank: int) -> tuple[S.Chunk, ...]:
    """What pipeline rank ``pp_rank`` builds, chunk by chunk, by Megatron-Core's functions."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_moe_layer_pattern,
    )
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    layout = args.pipeline_model_parallel_layout
    if isinstance(layout, str):
        layout = PipelineParallelLayerLayout.from_str(layout, pp)
    config = SimpleNamespace(
        num_layers=args.num_layers, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_model_parallel_layout=layout,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        moe_layer_freq=args.moe_layer_freq,
    )
    pattern = get_moe_layer_pattern(config) if args.num_experts else [0] * args.num_layers
    chunks = []
    with _pipeline_rank(pp, vpp, pp_rank) as ps:
        for vp in range(vpp or 1):
            vp_stage = vp if vpp else None
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            layers = tuple(S.Layer(offset + i + 1, bool(pattern[offset + i])) for i in range(count))
            chunks.append(S.Chunk(
                vp, layers,
                embedding=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                loss=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))
    return tuple(chunks)


def stage_ops(args, pp_rank: int, microbatches: int):
    """Pipeline rank ``pp_rank``'s op order from Megatron-Core's schedule generators."""
    from megatron_paging.mcore.op_order import interleaved_one_f_one_b, one_f_one_b

    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp and vpp > 1 and pp > 1:
        group = args.microbatch_group_size_per_vp_stage or pp
        return tuple(interleaved_one_f_one_b(
            pp, vpp, pp_rank, microbatches, group_size=group,
            combined_1f1b=bool(args.overlap_moe_expert_parallel_comm),
            delay_wgrad=bool(args.delay_wgrad_compute)))
    return tuple(one_f_one_b(pp, pp_rank, microbatches,
                             delay_wgrad=bool(args.delay_wgrad_compute)))


def as_launched(args, environ=None) -> str:
    """The arm the launch line itself runs."""
    environ = os.environ if environ is None else environ
    offload = set(args.offload_modules or []) if args.fine_grained_activation_offloading else set()
    if args.moe_paged_stash:
        if environ.get(IMPLEMENTATION_ENV, "ours") == "mcore":
            return "mcore"
        if offload and args.paging_offload_backend == "paged":
            return "paged_offload_experts" if offload & EXPERT_OFFLOAD else "paged_offload"
        return "paged_recompute_fc1" if args.paging_recompute_expert_fc1 else "paged"
    if args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or []):
        return "recompute"
    return "offload" if offload & EXPERT_OFFLOAD else "unpaged"


def plan_inputs(args, rank: int | None = None) -> PlanInputs:
    """Everything :func:`~megatron_paging.plan.model.build_plan` reads, for a validated line."""
    par = parallel(args)
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    pp_of, ep_of = rank_positions(args)
    if rank is not None and rank not in pp_of:
        raise PlanError(f"--rank {rank} is not a rank of a {args.world_size}-rank job")
    stages = []
    for s in range(par.pp):
        first = rank if (rank is not None and pp_of[rank] == s) else min(
            r for r, p in pp_of.items() if p == s)
        stages.append(StageInputs(s, stage_chunks(args, s), stage_ops(args, s, microbatches),
                                  global_rank=first, ep_rank=ep_of[first]))
    graphed = getattr(args, "cuda_graph_impl", "none") == "full_iteration"
    paging = PagingSettings(
        page_size=args.moe_paged_stash_page_size,
        cuda_factor=args.moe_paged_stash_buffer_size_factor_cuda,
        host_factor=args.moe_paged_stash_buffer_size_factor_cpu,
        hold_last_slot=bool(args.paging_hold_last_slot), persistent_pool=graphed,
        offload_host_factor=args.paging_offload_host_factor)
    schedule = "no pipelining" if par.pp == 1 else (
        f"interleaved 1F1B (VPP {par.vpp})" if par.vpp > 1 else "1F1B")
    notes = []
    if par.cp > 1:
        notes.append("context parallelism: tokens divided by CP; attention's ring buffers are "
                     "not modeled")
    if "core_attn" in (args.recompute_modules or []) and args.recompute_granularity:
        notes.append("--recompute-modules core_attn is not modeled (fused attention)")
    launched = as_launched(args)
    offloaded = set(args.offload_modules or [])
    if launched == "paged_offload_experts" and offloaded != EXPERT_OFFLOAD:
        notes.append(f"--offload-modules {' '.join(sorted(offloaded))}: modelled as "
                     "expert_fc1 moe_act alone (paged_offload_experts)")
    if not args.moe_expert_rank_capacity_factor and args.num_experts:
        notes.append("no --moe-expert-rank-capacity-factor: expert buffers sized to the routed "
                     "rows on average (no static capacity)")
    return PlanInputs(
        model=model_shape(args), parallel=par, microbatches=microbatches, stages=tuple(stages),
        paging=paging, as_launched=launched, load=args.paging_emulated_load,
        seed=args.seed, schedule=schedule, notes=tuple(notes),
        requested_stage=None if rank is None else pp_of[rank])


def plan_from_argv(argv: list[str], world_size: int | None = None, rank: int | None = None,
                   **build):
    """Parse a launch line and plan it (``build``: :func:`build_plan`'s keywords)."""
    from megatron_paging.plan.model import build_plan

    with quiet():
        inputs = plan_inputs(parse_megatron(argv, world_size, rank), rank)
    return build_plan(inputs, **build)


__all__ = ["REQUIRED_FLAGS", "PlanError", "as_launched", "check_required", "model_shape",
           "parallel", "parse_megatron", "plan_from_argv", "plan_inputs", "rank_positions",
           "stage_chunks", "stage_ops"]
