"""Pretrain a Megatron-Core GPT-MoE with paged expert activations (mock data).

Megatron's own ``pretrain()`` drives everything; this script only adds:

* ``install()`` first thing: Megatron-Core's paged-stash hook points, its step runner and the
  ``static`` flex dispatch backend now go through megatron-paging (and, with
  ``--fine-grained-activation-offloading --paging-offload-backend paged``, its activation
  offloading);
* our flags (``extra_args_provider=add_paging_args``) and their start-up validation;
* a model provider that builds ``GPTModel`` from the local (TE-free) layer spec with
  :class:`~megatron_paging.mcore.experts.PagedGroupedMLP` experts and fused SDPA core attention.

Start-up checks (a GPU, the paging flags, the benchmark controls) are :mod:`preflight`'s.

Launch: ``examples/run_pretrain_1gpu.sh`` (one GPU; its comment shows the EP/PP line).
Paged vs unpaged control: the same command with and without ``--moe-paged-stash`` (both keep
``--moe-flex-dispatcher-backend static --moe-expert-rank-capacity-factor F``, so the capacity
and the arithmetic are identical).
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import is_first_or_last_pipeline_stage
from preflight import EXAMPLE_DEFAULTS, check  # beside this script (its sys.path[0])
from step_probe import PROBE, observe_training_steps

from megatron_paging.mcore import install
from megatron_paging.mcore.flags import add_paging_args, install_options
from megatron_paging.mcore.offloading.shims import offload_args_lift
from megatron_paging.mcore.specs import get_gpt_moe_paged_block_spec

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
RECORD_LOAD_ENV = "MEGATRON_PAGING_BENCH_RECORD_LOAD"


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):
    """GPT-MoE on the local spec with paged grouped experts."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    spec = get_gpt_moe_paged_block_spec(
        config,
        normalization=args.normalization,
        vp_stage=vp_stage,
        recompute_expert_fc1=args.paging_recompute_expert_fc1,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage=None):
    """The microbatch on the stages that read data (first and last pipeline stage)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    return tuple(
        batch[k].cuda(device, non_blocking=True) if batch.get(k) is not None else None
        for k in BATCH_KEYS
    )


# A microbatch loss this many times the largest seen so far counts as a spike (as Megatron's GPT
# script has it): --check-for-spiky-loss re-runs its step in place.
SPIKY_LOSS_FACTOR = 10


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    # Megatron's result validation, as its GPT script does it: a NaN, Inf or (asked for) spiky
    # loss makes its rerun state machine run the step's forward-backward again in place, paging
    # included; --rerun-mode report_stats re-runs every step and compares.
    args, rerun = get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        rerun.validate_result(
            result=loss, rejection_func=partial(rerun.is_unexpectedly_large,
                                                threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    # fp32 [loss, tokens]: the loss log reads the loss back exactly (StepProbe.on_step_end).
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One microbatch's forward; with ``return_schedule_plan`` (Megatron-Core's combined 1F1B,
    ``--overlap-moe-expert-parallel-comm``) the model's schedule plan instead of its output."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels,
                                         loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-Core's mock GPT dataset (random tokens)."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split="1,1,1",
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )

    def built_on_rank():
        return (
            is_first_or_last_pipeline_stage(vp_stage)
            and parallel_state.get_tensor_model_parallel_rank() == 0
        )

    print_rank_0("> building mock GPT datasets")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, built_on_rank, config
    ).build()


def use_prebuilt_dataset_helpers() -> None:
    """Skip Megatron's ``make`` of the dataset helpers when the prebuilt module imports.

    The megatron-core wheel ships ``helpers_cpp`` compiled but not its Makefile, and Megatron's
    initialization runs ``make`` on rank 0 anyway, which then fails and exits. A source checkout
    (with the Makefile) is left alone.
    """
    from megatron.core.datasets import utils as dataset_utils

    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return
    makefile = os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")
    if not os.path.exists(makefile):
        dataset_utils.compile_helpers = lambda: None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    raw, config, controls = check()  # every paging flag and MEGATRON_PAGING_MAX_CTAS, once
    if controls.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(controls.memory_fraction)
    train_valid_test_datasets_provider.is_distributed = True
    # Before Megatron validates the arguments (the fake group's lift) and before any model or
    # config is built (the hook points are imported by name).
    options = install_options(raw, config, mcore_manager=controls.mcore_manager)
    api = install(**options)
    with offload_args_lift():  # Megatron's TE-only offloading assertion, where it does not apply
        args = parse_and_validate_args(
            extra_args_provider=add_paging_args, args_defaults=EXAMPLE_DEFAULTS
        )
    PROBE.peers = options.get("peers")
    if args.fake_process_group:
        # EMULATED: the data-loader flags rank 0 broadcasts. The fake group leaves them as this
        # rank set them, so a middle pipeline stage (no data loader of its own) would never train.
        args.do_train = (args.train_iters or 0) > 0
        args.do_valid = args.do_test = (args.eval_iters or 0) > 0
    recorder = start_recording(args)
    observe_training_steps(PROBE, step_mode=lambda: api.engine.mode)
    use_prebuilt_dataset_helpers()
    cfg = pretrain_cfg_container_from_args(args)
    cfg.model = None  # build through model_provider (our layer spec)
    try:
        pretrain(
            cfg,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
        )
    except SystemExit as stop:
        # --exit-interval, --exit-duration-in-mins or the exit signal: Megatron ends train()
        # with sys.exit(0) after its checkpoint; the last iteration's losses and the report
        # below still belong to the run. Any other code is a failure: passed on.
        if stop.code not in (None, 0):
            raise
    report_memory(api, "mcore" if controls.mcore_manager else "ours")
    if recorder is not None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        recorder.write(args.moe_router_topk, get_num_microbatches())
        print(f"paging-example: peer-load trace written to {recorder.path}", flush=True)


def start_recording(args):
    """``MEGATRON_PAGING_BENCH_RECORD_LOAD=<path>``: record the real router's routes as a
    peer-load trace (tools/peer_load.py: sequence p of each microbatch plays EP peer p)."""
    path = os.environ.get(RECORD_LOAD_ENV)
    if not path:
        return None
    from megatron_paging.mcore.dispatcher import StaticCapacityManager
    from megatron_paging.tools.peer_load import TraceRecorder

    recorder = TraceRecorder(path, peers=args.micro_batch_size,
                             source=f"examples/pretrain_gpt_moe_paged.py, seed {args.seed}")
    StaticCapacityManager.load_recorder = recorder
    return recorder


def _state_mib(model, optimizer) -> dict[str, float]:
    """Parameters, gradient buffers and optimizer state, in MiB (what is not activation)."""
    mib = 2**20
    params = {id(p): p for chunk in model or [] for p in chunk.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    grad_bytes = sum(
        g.numel() * g.element_size()
        for p in params.values()
        for g in (getattr(p, "main_grad", None), p.grad)
        if isinstance(g, torch.Tensor)
    )
    state_bytes = 0
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in getattr(torch_opt, "state", {}).values():
            state_bytes += sum(
                t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
            )
        masters = getattr(opt, "fp32_from_float16_groups", None) or getattr(
            opt, "shard_fp32_from_float16_groups", None
        )
        for group in masters or []:
            state_bytes += sum(p.numel() * p.element_size() for p in group)  # fp32 master copies
    return {"param_mib": param_bytes / mib, "grad_mib": grad_bytes / mib,
            "optimizer_state_mib": state_bytes / mib}


def report_memory(api, implementation: str) -> None:
    """One line per rank: peak memory and the page pools (what the GPU check compares)."""
    if implementation == "mcore":  # Megatron-Core's own manager holds the pages
        from megatron.core.transformer.moe.paged_stash import PagedStashManager

        manager = PagedStashManager.get_instance()
        # Megatron-Core's states: begin -> capture (first step) -> captured (pages every step).
        mode, steps = f"mcore-{manager.status}", manager.iteration
        buffers = manager.stash_buffers or {}
        cuda_bytes = sum(
            b.cuda_buffer.numel() * b.cuda_buffer.element_size()
            for per_dtype in buffers.values()
            for b in per_dtype.values()
        )
        host_bytes = sum(
            b.host_buffer.numel() * b.host_buffer.element_size()
            for per_dtype in buffers.values()
            for b in per_dtype.values()
            if b.host_buffer is not None
        )
    else:
        pools = api.engine.pools
        cuda_bytes, host_bytes = pools.total_bytes if pools is not None else (0, 0)
        # the last training step's (an evaluation after it runs unpaged)
        mode, steps = PROBE.training_mode or api.engine.mode, api.engine.steps
    mib = 2**20
    if hasattr(PROBE.runner, "finish"):  # ours: the last step's deferred flag read
        PROBE.runner.finish()
    PROBE.close_step()
    monitor = getattr(PROBE.runner, "monitor", None)  # our runner's overflow decisions
    actions = dict(monitor.actions) if monitor is not None else {}
    replays = api.engine.replays if implementation != "mcore" else 0
    dropped = getattr(PROBE.runner, "graph_invalidations", 0)  # graphs 'grow' made stale
    recalibrated = getattr(PROBE.runner, "recalibrations", 0)  # --step-batch-size-schedule
    state = _state_mib(PROBE.model, PROBE.optimizer)
    # Steady state: from the third step on (step 1 calibrates, step 2 allocates the pools and
    # the optimizer's lazy state).
    offload = _offload_report(api, implementation)
    print(
        f"paging-example rank {os.environ.get('RANK', '0')}: "
        f"peak_allocated_mib={PROBE.peak_mib():.1f} "
        f"steady_peak_allocated_mib={PROBE.peak_mib(first_iteration=3):.1f} "
        f"steady_fb_peak_allocated_mib={PROBE.peak_mib(3, forward_backward=True):.1f} "
        f"median_host_step_ms={PROBE.median_host_ms():.1f} "
        f"median_host_fb_ms={PROBE.median_host_ms(forward_backward=True):.1f} "
        f"peak_reserved_mib={torch.cuda.max_memory_reserved() / mib:.1f} "
        f"steady_alloc_retries={PROBE.steady_alloc_retries()} "
        f"pool_cuda_mib={cuda_bytes / mib:.1f} pool_host_mib={host_bytes / mib:.1f} "
        + "".join(f"{k}={v:.1f} " for k, v in state.items())
        + f"paging_mode={mode} paged_steps={steps} graph_replays={replays} "
        f"graphs_dropped={dropped} pools_recalibrated={recalibrated} "
        f"overflow_actions={','.join(f'{k}:{v}' for k, v in sorted(actions.items())) or '-'}"
        + "".join(f" {k}={v:.1f}" for k, v in offload.items())
        + _peers_report()
        + f" overflow={_overflow_records(monitor)}",
        flush=True,
    )


def _overflow_records(monitor) -> str:
    """Every overflow report of this rank (where, rows needed vs held, the flag and the factor
    that would have fitted, the policy) as one JSON list without spaces: a key=value field."""
    records = getattr(monitor, "overflow_records", [])
    return json.dumps(records, sort_keys=True, separators=(",", ":"))


def _peers_report() -> str:
    """What the emulated peers sent (``--fake-process-group``), or that there were none."""
    peers = PROBE.peers
    if peers is None:
        return " peers=none"
    stats = peers.stats
    return (f" peers=emulated:{peers.load.name()} peer_rows={stats.received_rows} "
            f"peer_dropped_rows={stats.dropped_rows} peer_exchanges={stats.exchanges}")


def _offload_report(api, implementation: str) -> dict[str, float]:
    """MiB the fine-grained offloading kept on the host and moved per step (empty when off)."""
    args = get_args()
    if not getattr(args, "fine_grained_activation_offloading", False):
        return {}
    mib = 2**20
    if getattr(args, "paging_offload_backend", "mcore") == "mcore":
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )

        manager = PipelineOffloadManager.get_instance()
        # Its pinned pool keeps every tensor it ever allocated, per (shape, dtype). Expert groups
        # (expert_fc1, moe_act, fused_group_mlp) bypass that pool (torch's pinned caching
        # allocator instead), so their host bytes are not in this count.
        host = sum(
            t.numel() * t.element_size()
            for entry in manager.cpu_tensor_pool._pools.values()
            for t in entry["all"]
        )
        # Megatron-Core's own summary: the bytes of the groups it offloads up to the first
        # backward chunk (one microbatch at PP = 1), not the bytes moved per step.
        summary = getattr(manager, "_offload_summary_total_bytes", 0)
        return {"offload_host_mib": host / mib, "offload_mcore_summary_mib": summary / mib}
    offload, pools = api.offload, api.engine.offload_pools
    live = offload.rows_live_bytes()  # the last step's, like the capacity and whole bytes
    return {
        "offload_host_mib": (pools.host_bytes() if pools is not None else 0) / mib,
        "offload_moved_per_step_mib": (live + offload.offloaded_bytes["whole"]) / mib,
        "offload_rows_live_mib": live / mib,
        "offload_rows_capacity_mib": offload.offloaded_bytes["rows_capacity"] / mib,
        "offload_whole_mib": offload.offloaded_bytes["whole"] / mib,
        # whole tensors that found no arena room and stayed on the device (since start)
        "offload_declined": getattr(getattr(pools, "arena", None), "declined", 0),
    }


if __name__ == "__main__":
    main()
