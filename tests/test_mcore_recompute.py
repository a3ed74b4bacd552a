"""The paging runtime under Megatron-Core's recompute, in a real MoELayer on the CPU: the
checkpointed forward saves nothing, and the recomputed forward runs inside the backward, where
paging stays off (its saved tensors are read right after it). A recomputed MoE layer must train
bit for bit as unpaged and page nothing. The flags that would recompute *every* MoE layer are
refused at start-up (tests/test_mcore_flags.py); this is what a partially recomputed model
(``--recompute-method block``) does in the layers it recomputes. The MoE layer's own recompute
(``moe_layer_recompute``) is the vehicle: it is the checkpoint a single layer can carry."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_fixtures import installed, model_parallel, moe_config  # noqa: E402, F401
from test_mcore_experts import _moe_layer, _train_steps  # noqa: E402


@pytest.fixture
def cpu_rng_states(monkeypatch):
    """A **fake** of Megatron-Core's checkpoint RNG bookkeeping for machines without CUDA: it
    saves and restores the CPU generator only (the real one also reads the CUDA generator and
    its tracker, which needs a driver). The layers here draw no random numbers in forward."""
    from megatron.core.tensor_parallel import random as mcore_random

    monkeypatch.setattr(mcore_random, "_get_all_rng_states",
                        lambda: (torch.get_rng_state(), None, None))
    monkeypatch.setattr(mcore_random, "_set_all_rng_states",
                        lambda cpu, cuda, tracker: torch.set_rng_state(cpu))


@pytest.mark.parametrize("modules", [["moe"]], ids=["moe"])
def test_paged_stash_with_selective_recompute_is_bitwise_equal(
    installed, model_parallel, cpu_rng_states, modules  # noqa: F811
):
    api = installed
    torch.manual_seed(0)
    config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0,
                        recompute_granularity="selective", recompute_modules=modules)
    layer = _moe_layer(config)
    unpaged = _train_steps(api, layer, config, paged=False)
    paged = _train_steps(api, layer, config, paged=True)
    for (l_u, g_u, h_u), (l_p, g_p, h_p) in zip(unpaged, paged, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l_u, l_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(g_u, g_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(h_u, h_p, strict=True))
    assert not bool(api.check_paged_stash_overflow())
    # The checkpointed forward saves nothing and the recompute inside the backward is not
    # paged (its tensors are read right after it): no stash, no reload, no record at all.
    scheduler = api.engine.scheduler
    launches = [] if scheduler is None else scheduler.backend.entries("launch")
    assert launches == []
    api.paged_stash_reset(enabled=False, config=config)
