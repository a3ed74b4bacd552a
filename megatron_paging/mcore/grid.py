"""A validated Megatron line's parallel grid: its sizes as the plan's :class:`Parallel`, where
each global rank sits in it (Megatron-Core's ``RankGenerator``), and the route shape the
emulated peers serve a rank. Reads args only (no flags of ours, no plan): the start-up checks
and the plan both use it."""

from __future__ import annotations

from megatron_paging.plan import shapes as S


def parallel(args) -> S.Parallel:
    return S.Parallel(
        world=args.world_size, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size or 1,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        cp=args.context_parallel_size, sequence_parallel=bool(args.sequence_parallel),
        distributed_optimizer=bool(args.use_distributed_optimizer),
        grads_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
    )


def rank_positions(args) -> tuple[dict[int, int], dict[int, int]]:
    """Global rank -> (pipeline rank, expert-parallel rank), from Megatron's RankGenerator."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    dense = RankGenerator(tp=tp, ep=1, dp=args.data_parallel_size, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=args.world_size // (etp * ep * pp), pp=pp, cp=1,
                           order=order)
    pp_of = {r: i for group in dense.get_ranks("pp") for i, r in enumerate(group)}
    ep_of = {r: i for group in expert.get_ranks("ep") for i, r in enumerate(group)}
    return pp_of, ep_of


def route_shape(args, rank: int):
    """What the emulated peers route to global ``rank`` (a
    :class:`~megatron_paging.tools.peer_load.RouteShape`: tokens per dispatch, top-k, experts,
    EP size, this rank's EP position): the layout a peer-load trace must be recorded for."""
    from megatron_paging.tools.peer_load import RouteShape

    par = parallel(args)
    _, stream_tokens = S.token_counts(args.seq_length, args.micro_batch_size, par)
    return RouteShape(stream_tokens, args.moe_router_topk, args.num_experts, par.ep,
                      rank_positions(args)[1][rank])


__all__ = ["parallel", "rank_positions", "route_shape"]
