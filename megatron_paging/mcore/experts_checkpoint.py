"""The distributed-checkpoint layout of :class:`~megatron_paging.mcore.experts.PagedGroupedMLP`:
Megatron-Core's own expert layout, so a checkpoint moves between paged experts and Megatron-Core's
(``SequentialMLP``, ``TEGroupedMLP``) and every expert-parallel rank saves its own experts.

``PagedGroupedMLP`` holds all local experts in two parameters, ``weight1 [experts, fc1_out,
hidden]`` and ``weight2 [experts, hidden, ffn]``. Megatron-Core's checkpoint keys each expert's
``linear_fc1.weight`` / ``linear_fc2.weight`` as one slice of a global expert axis (offset: this
rank's first global expert plus the local index), replicated over the expert-data-parallel
group; a gated fc1 is saved as its two halves (gate rows, then up rows), as
``apply_swiglu_sharded_factory`` does. MegatronModule's default would key ``weight1`` whole,
with no expert axis and replicas counted over the dense data-parallel group: under EP > 1 only
one rank's experts would be written, and every rank would load those.

Each parameter becomes one ``ShardedTensorFactory`` (build: per-expert shards; merge: stacked back),
so the optimizer's states of the same shape are saved in the same layout. Megatron-Core's experts
also save one extra state per expert and linear (``None`` for its local linears, fp8 metadata for
TE's) and ask for them on load; these experts save ``None`` under the same keys (the module's
``_extra_state``) and drop what they load there, so a checkpoint loads either way under Megatron's
default ``--dist-ckpt-strictness``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

SWIGLU_AXIS = 0  # fc1's output rows: gate half, then up half (Megatron-Core's glu chunks them)


def expert_groups(pg_collection):
    """``(ep, expt_dp)`` process groups of the experts: the collection's, else parallel_state's."""
    if pg_collection is not None:
        return pg_collection.ep, pg_collection.expt_dp
    return (parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_data_parallel_group())


def experts_sharded_state_dict(module, prefix: str, sharded_offsets: tuple) -> dict:
    """``{prefix}weight1`` and ``{prefix}weight2`` as factories of Megatron-Core's expert shards
    (keys ``{prefix}experts.linear_fc1.weight`` / ``linear_fc2.weight``), and
    ``{prefix}_extra_state`` as Megatron-Core's per-expert extra states."""
    ep_group, expt_dp_group = expert_groups(module.pg_collection)
    local = module.num_local_experts
    first_global = get_pg_rank(ep_group) * local
    global_experts = get_pg_size(ep_group) * local
    # (PP, TP, DP): stages hold other layers, expert TP is 1, one writer per expert-DP group
    replica_id = (0, 0, get_pg_rank(expt_dp_group))
    gated = bool(module.config.gated_linear_unit)
    factories = {}
    for attr, name, halves in (("weight1", "linear_fc1", gated), ("weight2", "linear_fc2", False)):
        factories[f"{prefix}{attr}"] = ShardedTensorFactory(
            key=f"{prefix}experts.{name}.weight",
            data=getattr(module, attr),
            build_fn=_build(sharded_offsets, first_global, global_experts, halves),
            merge_fn=_merge(halves),
            replica_id=replica_id,
        )
    factories[f"{prefix}_extra_state"] = [
        make_sharded_object_for_checkpoint(
            None, f"{prefix}experts.{name}._extra_state",
            (*sharded_offsets, (len(sharded_offsets), first_global + index, global_experts)),
            replica_id)
        for name in ("linear_fc1", "linear_fc2") for index in range(local)
    ]
    return factories


def _build(sharded_offsets: tuple, first_global: int, global_experts: int, halves: bool):
    expert_axis = len(sharded_offsets)
    prepend = expert_axis + 1  # the expert axis is prepended too: each shard is one expert

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            # only a distributed-optimizer checkpoint of Megatron-Core < 0.13 saved with
            # --ckpt-fully-parallel-save (fully_sharded_model_space) is read this way
            raise ValueError(f"{key}: PagedGroupedMLP's experts cannot load flattened optimizer "
                             "shards (Megatron-Core < 0.13's fully_sharded_model_space); load "
                             "with --no-load-optim, or re-save the checkpoint with "
                             "--dist-ckpt-optim-fully-reshardable first")
        shards = []
        for local_index, expert in enumerate(data.unbind(0)):
            offsets = (*sharded_offsets, (expert_axis, first_global + local_index,
                                          global_experts))
            parts = expert.chunk(2, dim=SWIGLU_AXIS) if halves else (expert,)
            shards.append([
                ShardedTensor.from_rank_offsets(
                    key, part, *offsets,
                    *(((prepend + SWIGLU_AXIS, index, 2),) if halves else ()),
                    replica_id=replica_id, prepend_axis_num=prepend)
                for index, part in enumerate(parts)
            ])
        return shards

    return build


def _merge(halves: bool):
    def merge(shards):
        return torch.stack([torch.cat(parts, dim=SWIGLU_AXIS) if halves else parts[0]
                            for parts in shards])

    return merge


__all__ = ["expert_groups", "experts_sharded_state_dict"]
