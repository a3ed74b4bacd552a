"""``--paging-recompute-expert-fc1`` on CPU: PagedGroupedMLP that saves only its input and
recomputes fc1 in backward gives bit-identical outputs and gradients to the one that saves fc1,
saves nothing fc1-sized, issues the fc2 dgrad before it unpacks ``x``, and inside a real
Megatron-Core MoELayer pages only ``x`` (one pool) bitwise equal to the unpaged control."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from mcore_fixtures import installed, model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.mcore.experts import PagedGroupedMLP  # noqa: E402

HIDDEN, FFN, CAPACITY = 32, 48, 24
COUNTS = [5, 0, 7, 3]


def _pair(gemm_backend="loop", gated=True, fused=False):
    """The same experts (same weights) with and without the fc1 recompute."""
    config = moe_config(
        hidden_size=HIDDEN, moe_ffn_hidden_size=FFN, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu, bias_activation_fusion=fused,
    )
    torch.manual_seed(0)
    saving = PagedGroupedMLP(4, config, gemm_backend=gemm_backend)
    recomputing = PagedGroupedMLP(4, config, gemm_backend=gemm_backend, recompute_fc1=True)
    recomputing.load_state_dict(saving.state_dict())
    return saving, recomputing


def _run(module, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(CAPACITY, HIDDEN, generator=gen).requires_grad_()
    probs = torch.rand(CAPACITY, generator=gen).requires_grad_()
    out, _ = module(x, torch.tensor(COUNTS), probs)
    live = sum(COUNTS)
    grad = torch.randn(live, HIDDEN, generator=gen)
    (out[:live] * grad).sum().backward()
    # rows past the live prefix are undefined (grouped_mm leaves them unwritten)
    return [out[:live], x.grad[:live], probs.grad[:live], module.weight1.grad,
            module.weight2.grad]


@pytest.mark.parametrize("gated, activation", [
    (True, "unfused"), (True, "fused"),
    (False, "unfused"),  # the fused activation is SwiGLU (gated silu) only
])
@pytest.mark.parametrize("gemm_backend", ["loop", "grouped"])
def test_recomputed_fc1_gives_bitwise_the_same_outputs_and_gradients(
    installed, model_parallel, gemm_backend, gated, activation  # noqa: F811
):
    # fused: the fused SwiGLU's formulas (their torch reference on CPU).
    saving, recomputing = _pair(gemm_backend, gated, fused=activation == "fused")
    expected, got = _run(saving), _run(recomputing)
    names = ["output", "x.grad", "probs.grad", "weight1.grad", "weight2.grad"]
    for name, a, b in zip(names, expected, got, strict=True):
        assert torch.equal(a, b), name
    assert recomputing.weight1.grad.abs().sum() > 0  # the recomputed fc1 reached dw1


def test_only_the_input_is_saved_and_the_fc2_dgrad_runs_before_it_comes_back(
    installed, model_parallel, monkeypatch  # noqa: F811
):
    from megatron_paging.mcore import experts

    _, module = _pair()
    events, real_gmm = [], experts._gmm
    monkeypatch.setattr(experts, "_gmm", lambda a, b, *r: (
        events.append(("gmm", tuple(a.shape), tuple(b.shape))), real_gmm(a, b, *r))[1])
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    def unpack(t):
        events.append(("unpack", tuple(t.shape)))
        return t

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(CAPACITY, HIDDEN, generator=gen).requires_grad_()
    probs = torch.rand(CAPACITY, generator=gen).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out, _ = module(x, torch.tensor(COUNTS), probs)
    assert sorted(packed) == sorted([(CAPACITY, HIDDEN), (CAPACITY,)])  # x and probs, no fc1
    events.clear()
    out.sum().backward()
    # fc2 dgrad (dout [C, H] x w2 [E, H, F]) first, then x comes back, then fc1 is recomputed
    assert events[0] == ("gmm", (CAPACITY, HIDDEN), tuple(module.weight2.shape))
    assert events[1][0] == "unpack" and ("unpack", (CAPACITY, HIDDEN)) in events[1:3]
    gmms = [e for e in events if e[0] == "gmm"]
    assert len(gmms) == 5  # fc2 dgrad, fc1 recompute, fc2 wgrad, fc1 wgrad, fc1 dgrad
    assert gmms[1] == ("gmm", (CAPACITY, HIDDEN), (4, HIDDEN, 2 * FFN))  # x @ W1^T


def test_recompute_with_offloaded_moe_act_is_refused(installed, model_parallel):  # noqa: F811
    config = moe_config(fine_grained_activation_offloading=True,
                        offload_modules=["expert_fc1", "moe_act"])
    with pytest.raises(ValueError, match="drop moe_act") as error:
        PagedGroupedMLP(4, config, recompute_fc1=True)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(config=dict(activation_func_clamp_value=7.0)), "no activation_func_clamp_value"),
    (dict(config=dict(activation_func=F.gelu, gated_linear_unit=True)), "fuses only SwiGLU"),
])
def test_fused_activation_refuses_what_it_cannot_compute(
    installed, model_parallel, overrides, message  # noqa: F811
):
    config = moe_config(bias_activation_fusion=True, **overrides.pop("config", {}))
    with pytest.raises(ValueError, match=message) as error:
        PagedGroupedMLP(4, config, recompute_fc1=True, **overrides)
    assert "\n" not in str(error.value)


def test_fusion_flag_picks_the_activation(installed, model_parallel):  # noqa: F811
    from megatron_paging.mcore.expert_activation import FusedSwiglu, TorchActivation

    assert isinstance(PagedGroupedMLP(4, moe_config()).activation, TorchActivation)
    fused = PagedGroupedMLP(4, moe_config(bias_activation_fusion=True)).activation
    assert isinstance(fused, FusedSwiglu)


def test_moe_layer_paged_with_recompute_pages_only_x_and_matches_unpaged(
    installed, model_parallel  # noqa: F811
):
    import dataclasses
    from functools import partial

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from test_mcore_experts import _train_steps

    from megatron_paging.mcore.specs import paged_moe_mlp_builder

    class CpuTopKRouter(TopKRouter):
        """Megatron's TopKRouter.gating moves its weight to CUDA; gate on the CPU instead."""

        def gating(self, input):
            return F.linear(input.float(), self.weight.float())

    def layer(recompute_fc1):
        torch.manual_seed(0)
        builder = paged_moe_mlp_builder(config.num_moe_experts, "grouped", recompute_fc1)
        submodules = dataclasses.replace(builder.keywords["submodules"], router=CpuTopKRouter)
        return partial(builder.func, submodules=submodules)(
            config=config, layer_number=1, pg_collection=get_default_pg_collection())

    api = installed
    config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)
    control = _train_steps(api, layer(False), config, paged=False)
    paged = _train_steps(api, layer(True), config, paged=True)
    assert api.engine.mode == "paged"
    assert [pool.row_bytes for pool in api.engine.pools] == [config.hidden_size * 4]  # x only
    for (l_u, g_u, h_u), (l_p, g_p, h_p) in zip(control, paged, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l_u, l_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(g_u, g_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(h_u, h_p, strict=True))
    api.paged_stash_reset(enabled=False, config=config)


def _args(argv):
    from megatron_paging.mcore import flags

    parser = flags.add_paging_args(argparse.ArgumentParser())
    parser.add_argument("--fine-grained-activation-offloading", action="store_true")
    parser.add_argument("--offload-modules", nargs="*", default=None)
    # Megatron's own two (the example passes --swiglu; fusion is on unless turned off)
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    return flags, parser.parse_args(argv)


def test_the_flag_builds_the_unpaged_model_too_and_refuses_moe_act_offload():
    flags, args = _args(["--paging-recompute-expert-fc1"])
    assert args.paging_recompute_expert_fc1 is True
    assert flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
    flags, args = _args(["--paging-recompute-expert-fc1", "--fine-grained-activation-offloading",
                         "--offload-modules", "expert_fc1", "moe_act"])
    with pytest.raises(ValueError, match="--offload-modules moe_act .*--paging-recompute-expert"):
        flags.paging_config(args, environ={}, cuda_available=False, te_available=False)


def test_the_flag_reaches_the_experts_through_the_spec(installed, model_parallel):  # noqa: F811
    from megatron_paging.mcore.specs import get_gpt_moe_paged_layer_spec

    flags, args = _args(["--swiglu", "--paging-recompute-expert-fc1"])
    spec = get_gpt_moe_paged_layer_spec(
        4, recompute_expert_fc1=flags.paging_args(args).paging_recompute_expert_fc1)
    experts = spec.submodules.mlp.keywords["submodules"].experts
    assert experts.keywords == {"gemm_backend": "auto", "recompute_fc1": True}
