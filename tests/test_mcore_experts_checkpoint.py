"""PagedGroupedMLP's distributed checkpoint on CPU: the same shards as Megatron-Core's own experts
(SequentialMLP) for any expert-parallel rank, a save/load round trip through Megatron's
dist_checkpointing in both directions between the two modules, and expert TP refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_fixtures import installed, model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.mcore.experts import PagedGroupedMLP  # noqa: E402

LOCAL_EXPERTS = 3
LAYER_OFFSETS = ((0, 5, 12),)  # the decoder block's layer axis, as TransformerBlock passes it
PREFIX = "decoder.layers.mlp.experts."


class _Group:
    """A process group's rank and size (all the checkpoint layout reads of one)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _modules(gated: bool, seed: int = 0):
    """Ours and Megatron-Core's SequentialMLP (local spec) holding the same expert weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    config = moe_config(gated_linear_unit=gated,
                        activation_func=torch.nn.functional.silu if gated else
                        torch.nn.functional.gelu)
    ours = PagedGroupedMLP(LOCAL_EXPERTS, config)
    # the local spec's experts (get_gpt_layer_local_spec, moe_grouped_gemm=False)
    mlp_submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    theirs = SequentialMLP(LOCAL_EXPERTS, config, mlp_submodules,
                           pg_collection=get_default_pg_collection())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ours.weight1.copy_(torch.randn(ours.weight1.shape, generator=gen))
        ours.weight2.copy_(torch.randn(ours.weight2.shape, generator=gen))
        for e, expert in enumerate(theirs.local_experts):
            expert.linear_fc1.weight.copy_(ours.weight1[e])
            expert.linear_fc2.weight.copy_(ours.weight2[e])
    return ours, theirs


def _at_rank(ours, theirs, ep: _Group, expt_dp: _Group):
    ours.pg_collection = SimpleNamespace(ep=ep, expt_dp=expt_dp)
    theirs.ep_group, theirs.dp_group = ep, expt_dp


def _shards(sharded_state_dict) -> list:
    """Every ShardedTensor, factories built: (key, global shape, offset, local shape, replica,
    data, prepended axes); every ShardedObject: (key, global shape, offset, None, replica, data,
    None)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    found = []

    def walk(x):
        if isinstance(x, ShardedTensorFactory):
            walk(x.build())
        elif isinstance(x, ShardedTensor):
            found.append((x.key, x.global_shape, x.global_offset, x.local_shape, x.replica_id,
                          x.data, x.prepend_axis_num))
        elif isinstance(x, ShardedObject):
            found.append((x.key, x.global_shape, x.global_offset, None, x.replica_id, x.data,
                          None))
        elif isinstance(x, dict):
            for value in x.values():
                walk(value)
        elif isinstance(x, list | tuple):
            for value in x:
                walk(value)

    walk(sharded_state_dict)
    return sorted(found, key=lambda s: (s[0], s[2]))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("ep_rank,ep_size,edp_rank", [(0, 1, 0), (1, 4, 2), (3, 4, 0)])
def test_shards_are_megatron_cores_expert_shards(installed, model_parallel, gated, ep_rank, ep_size,  # noqa: F811
                                                 edp_rank):
    ours, theirs = _modules(gated)
    _at_rank(ours, theirs, _Group(ep_rank, ep_size), _Group(edp_rank, 3))
    mine = _shards(ours.sharded_state_dict(PREFIX, LAYER_OFFSETS))
    megatron = _shards(theirs.sharded_state_dict(PREFIX, LAYER_OFFSETS))
    assert [s[:5] for s in mine] == [s[:5] for s in megatron]
    assert all(a[5] is b[5] is None or torch.equal(a[5], b[5])
               for a, b in zip(mine, megatron, strict=True))
    assert {s[0] for s in mine if s[3] is None} == {  # the per-expert extra states
        f"{PREFIX}experts.linear_fc1._extra_state", f"{PREFIX}experts.linear_fc2._extra_state"}
    # each expert of this rank at its global index: distinct ranks write distinct experts
    experts = {s[2][1] for s in mine}
    assert experts == set(range(ep_rank * LOCAL_EXPERTS, (ep_rank + 1) * LOCAL_EXPERTS))
    assert {s[4] for s in mine} == {(0, 0, edp_rank)}


def test_flattened_optimizer_shards_are_refused(installed, model_parallel):  # noqa: F811
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    ours, _ = _modules(gated=True)
    factory = ours.sharded_state_dict(PREFIX, LAYER_OFFSETS)[f"{PREFIX}weight1"]
    assert isinstance(factory, ShardedTensorFactory)
    with pytest.raises(ValueError, match="flattened"):
        factory.build_fn(factory.key, factory.data, factory.replica_id, slice(0, 4))


def _region(offset, local_shape, prepend: int) -> tuple:
    return (*offset[:prepend], *(slice(o, o + n) for o, n in zip(offset[prepend:], local_shape,
                                                                 strict=True)))


def _through_a_checkpoint(source_sd: dict, target_sd: dict) -> dict:
    """What Megatron's dist_checkpointing does between a save of ``source_sd`` and a load into
    ``target_sd``, without the files (its torch_dist writer needs CUDA): the source's shards are
    assembled into global tensors by key; the target's factories are built, each of its shards
    read from those, and the factories merged back (Megatron's own apply_factories and
    apply_factory_merges)."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        extract_matching_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    stored, objects = {}, {}
    for key, global_shape, offset, local_shape, _, data, prepend in _shards(source_sd):
        if local_shape is None:
            objects[key, offset] = data
            continue
        region = stored.setdefault(key, torch.full(global_shape, float("nan")))
        region[_region(offset, local_shape, prepend)] = data
    assert not any(t.isnan().any() for t in stored.values())  # every element saved once

    def read(sh):  # a missing key raises, as the torch_dist load does by default
        if isinstance(sh, ShardedObject):
            return objects[sh.key, sh.global_offset]
        return stored[sh.key][_region(sh.global_offset, sh.local_shape,
                                      sh.prepend_axis_num)].clone()

    factories, _ = extract_matching_values(target_sd,
                                           lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(target_sd)
    dict_list_map_inplace(read, target_sd)
    return apply_factory_merges(target_sd, factories)


@pytest.mark.parametrize("direction", ["paged-to-megatron", "megatron-to-paged"])
def test_a_checkpoint_loads_across_paged_and_megatron_core_experts(installed, model_parallel,  # noqa: F811
                                                                   direction):

    source_ours, source_theirs = _modules(gated=True, seed=1)
    target_ours, target_theirs = _modules(gated=True, seed=2)
    source = source_ours if direction == "paged-to-megatron" else source_theirs
    target = target_theirs if direction == "paged-to-megatron" else target_ours
    whole = ((0, 0, 1),)  # one layer, one rank: the shards cover the global tensors
    loaded = _through_a_checkpoint(source.sharded_state_dict(PREFIX, whole),
                                   target.sharded_state_dict(PREFIX, whole))
    target.load_state_dict({k.removeprefix(PREFIX): v for k, v in loaded.items()})
    for e in range(LOCAL_EXPERTS):
        fc1 = (target_theirs.local_experts[e].linear_fc1.weight if target is target_theirs
               else target_ours.weight1[e])
        fc2 = (target_theirs.local_experts[e].linear_fc2.weight if target is target_theirs
               else target_ours.weight2[e])
        assert torch.equal(fc1, source_ours.weight1[e])
        assert torch.equal(fc2, source_ours.weight2[e])


def test_expert_tensor_parallelism_is_refused(installed, model_parallel):  # noqa: F811
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size"):
        PagedGroupedMLP(2, moe_config(), pg_collection=SimpleNamespace(expt_tp=_Group(0, 2)))


def test_optimizer_states_are_saved_in_the_experts_layout(installed, model_parallel):  # noqa: F811
    """Megatron's optimizer checkpoint maps each state of a parameter onto that parameter's
    sharded form (optim_state_to_sharding_state, as its non-distributed optimizers call it):
    Adam's moments are saved per expert under Megatron-Core's expert keys."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    ours, _ = _modules(gated=True)
    params = [ours.weight1, ours.weight2]
    optimizer = torch.optim.Adam(params, lr=0.1)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state_dict()
    optim_state_to_sharding_state(
        state, get_param_id_to_sharded_param_map(ours.sharded_state_dict(PREFIX, LAYER_OFFSETS),
                                                 params), exclude_keys="step")
    shards = _shards(state["state"])
    for moment in ("exp_avg", "exp_avg_sq"):
        for param, name in ((ours.weight1, "linear_fc1"), (ours.weight2, "linear_fc2")):
            key = f"optimizer.state.{moment}.{PREFIX}experts.{name}.weight"
            mine = [s for s in shards if s[0] == key]
            halves = 2 if name == "linear_fc1" else 1  # the gated fc1's gate and up rows
            assert len(mine) == LOCAL_EXPERTS * halves
            want = [part for expert in optimizer.state[param][moment]
                    for part in expert.chunk(halves)]
            assert all(torch.equal(got[5], part) for got, part in zip(mine, want, strict=True))
