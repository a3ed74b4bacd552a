"""Shared Megatron-Core set-up for the tests/test_mcore_*.py files (CPU, one process).

Megatron-Core's MoE modules read process groups from ``parallel_state``: the fixture starts a
real single-process gloo group and ``initialize_model_parallel()`` once per test module, and
tears both down after it.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_parallel():
    """gloo world of one + Megatron-Core's default model-parallel groups (all of size 1)."""
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{free_port()}"
        )
    parallel_state.initialize_model_parallel()
    try:
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def moe_config(**overrides):
    """A small MoE TransformerConfig for CPU tests (fp32, no TE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=48,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="static",
        moe_expert_rank_capacity_factor=1.5,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


@pytest.fixture(scope="module")
def installed():
    """megatron-paging installed for the module (the static backend needs the config shim)."""
    from megatron_paging.mcore.installer import PagingInstaller

    installer = PagingInstaller()
    api = installer.install()
    try:
        yield api
    finally:
        installer.uninstall()


def cpu_moe_layer(config, layer_number: int = 1):
    """Megatron-Core's MoELayer from our spec (PagedGroupedMLP, our flex dispatcher) whose router
    gates on the CPU (Megatron's ``TopKRouter.gating`` moves its weight to CUDA)."""
    import dataclasses
    from functools import partial

    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_paging.mcore.specs import paged_moe_mlp_builder

    class CpuTopKRouter(TopKRouter):
        def gating(self, input):
            return F.linear(input.float(), self.weight.float())

    builder = paged_moe_mlp_builder(config.num_moe_experts, gemm_backend="grouped")
    submodules = dataclasses.replace(builder.keywords["submodules"], router=CpuTopKRouter)
    builder = partial(builder.func, submodules=submodules)
    return builder(
        config=config, layer_number=layer_number, pg_collection=get_default_pg_collection()
    )
