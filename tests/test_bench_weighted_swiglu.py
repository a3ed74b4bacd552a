"""The weighted-SwiGLU benchmark's arms on the CPU: its unfused arm is Megatron-Core's
expression (the experts' own with --no-bias-swiglu-fusion), its fused arm the kernel module;
they agree within the unfused expression's roundings, and the benchmark refuses to run
without a GPU in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from frontier_bench import load_script

bench = load_script("bench_weighted_swiglu")


def test_unfused_arm_is_the_experts_unfused_activation():
    from types import SimpleNamespace

    from megatron_paging.mcore.expert_activation import TorchActivation

    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(12, 16, generator=gen).bfloat16()
    probs, dinter = torch.rand(12, generator=gen), torch.randn(12, 8, generator=gen).bfloat16()
    config = SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                             activation_func_clamp_value=None, glu_linear_offset=0.0)
    experts = TorchActivation(config)
    for a, b in zip(bench.unfused_backward(fc1, probs, dinter),
                    experts.backward(fc1, probs, dinter), strict=True):
        assert torch.equal(a, b)
    fused = bench.ARMS["fused"][1](fc1, probs, dinter)
    for a, b in zip(bench.unfused_backward(fc1, probs, dinter), fused, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2**-5, atol=0.05 * b.abs().max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])
