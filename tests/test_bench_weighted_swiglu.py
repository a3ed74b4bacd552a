"""The weighted-SwiGLU benchmark's arms on the CPU: its unfused arm is the experts' own
activation with --no-bias-swiglu-fusion (Megatron-Core's expression), its fused arm the kernel
module; they agree within the unfused expression's roundings, and the benchmark refuses to run
without a GPU in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from frontier_bench import load_script

bench = load_script("bench_weighted_swiglu")


def test_unfused_arm_is_the_experts_unfused_activation():
    from megatron_paging.mcore.expert_activation import TorchActivation

    unfused = bench.ARMS["unfused"][1].__self__
    assert isinstance(unfused, TorchActivation)
    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(12, 16, generator=gen).bfloat16()
    probs, dinter = torch.rand(12, generator=gen), torch.randn(12, 8, generator=gen).bfloat16()
    # the unfused arm is Megatron-Core's expression: silu(gate) * linear, times probs, rounded
    gate, linear = fc1.chunk(2, dim=-1)
    expected = ((F.silu(gate) * linear) * probs.unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(bench.ARMS["unfused"][0](fc1, probs), expected)
    fused = bench.ARMS["fused"][1](fc1, probs, dinter)
    for a, b in zip(bench.ARMS["unfused"][1](fc1, probs, dinter), fused, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2**-5, atol=0.05 * b.abs().max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main([])
    assert done.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
