"""The fused prob-weighted SwiGLU (megatron_paging/kernels/weighted_swiglu.py).

CPU: the reference formulas against float64 autograd of ``silu(gate) * linear * probs`` and
against Megatron-Core's unfused expression, one-line argument errors. GPU (marker ``gpu``): the
kernel against the reference on the same device — vectorized and scalar paths, three dtypes,
bf16 probs, outputs over inputs, empty buffers, CUDA-graph replay — printing the differences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_paging.kernels import weighted_swiglu as ws


def _inputs(rows, cols, dtype=torch.bfloat16, probs_dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(rows, 2 * cols, generator=gen) * 3).to(dtype).to(device)
    probs = torch.rand(rows, generator=gen).to(probs_dtype).to(device)
    dinter = torch.randn(rows, cols, generator=gen).to(dtype).to(device)
    return fc1, probs, dinter


def _float64_truth(fc1, probs, dinter):
    fc1_ = fc1.double().requires_grad_()
    probs_ = probs.double().requires_grad_()
    gate, linear = fc1_.chunk(2, dim=-1)
    inter = F.silu(gate) * linear * probs_.unsqueeze(-1)
    dfc1, dprobs = torch.autograd.grad(inter, (fc1_, probs_), dinter.double())
    return inter.detach(), dfc1, dprobs


def _ulps(got, want):
    """Differences in units of the last place of ``got``'s dtype at ``want``'s magnitude."""
    eps = torch.finfo(got.dtype).eps
    scale = want.abs().clamp_min(torch.finfo(got.dtype).tiny) * eps
    return ((got.double() - want.double()).abs() / scale).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_silu_times_linear_times_probs_rounded_once(dtype):
    fc1, probs, dinter = _inputs(37, 24, dtype)
    inter, dfc1, dprobs = ws.reference_backward(fc1, probs, dinter)
    t_inter, t_dfc1, t_dprobs = _float64_truth(fc1, probs, dinter)
    # fp32 math rounded once to dtype: within one rounding of the float64 truth (plus fp32's
    # own error, which only matters for dtype float32).
    tolerance = 1.0 if dtype != torch.float32 else 64.0
    assert _ulps(inter, t_inter) <= tolerance
    assert _ulps(dfc1, t_dfc1) <= tolerance
    assert torch.allclose(dprobs.double(), t_dprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(ws.reference_forward(fc1, probs), inter)  # forward = backward's inter


def test_reference_is_closer_to_the_truth_than_megatrons_unfused_expression():
    """Megatron-Core's unfused expression rounds silu, the product and the prob gradient's
    terms to bf16; one rounding of fp32 math is nearer the float64 truth on every output."""
    fc1, probs, dinter = _inputs(64, 40)
    fc1_, probs_ = fc1.clone().requires_grad_(), probs.clone().requires_grad_()
    gate, linear = torch.chunk(fc1_, 2, dim=-1)
    act = F.silu(gate) * linear
    unfused = (act * probs_.unsqueeze(-1)).to(act.dtype)
    dfc1_unfused, dprobs_unfused = torch.autograd.grad(unfused, (fc1_, probs_), dinter)
    fused = ws.reference_backward(fc1, probs, dinter)
    truth = _float64_truth(fc1, probs, dinter)
    for name, f, u, t in zip(("inter", "dfc1", "dprobs"), fused,
                             (unfused.detach(), dfc1_unfused, dprobs_unfused), truth,
                             strict=True):
        fused_error = (f.double() - t).abs().mean().item()
        unfused_error = (u.double() - t).abs().mean().item()
        assert fused_error <= unfused_error, name
        assert not torch.equal(f, u), name  # they are different roundings, not one


def test_probs_as_a_column_keep_their_shape_and_dtype():
    fc1, probs, dinter = _inputs(9, 8, probs_dtype=torch.bfloat16)
    inter, dfc1, dprobs = ws.backward(fc1, probs.reshape(-1, 1), dinter)
    assert dprobs.shape == (9, 1) and dprobs.dtype == torch.bfloat16
    assert inter.shape == (9, 8) and dfc1.shape == (9, 16)


@pytest.mark.parametrize("call, message", [
    (lambda f, p, d: ws.forward(f[:, :15], p), r"fc1 must be a 2-D tensor \[rows, 2 \* cols\]"),
    (lambda f, p, d: ws.forward(f.to(torch.int32), p), "fc1 must be float32, bfloat16"),
    (lambda f, p, d: ws.forward(f, p[:5]), r"probs must hold one value per fc1 row \(9\)"),
    (lambda f, p, d: ws.forward(f, p.to(torch.int64)), "probs must be float32"),
    (lambda f, p, d: ws.backward(f, p, d[:, :4]), r"dinter must be \[9, 8\]"),
    (lambda f, p, d: ws.backward(f, p, d.float()), "dinter must be torch.bfloat16 like fc1"),
    (lambda f, p, d: ws.forward(f.reshape(-1), p), "fc1 must be a 2-D tensor"),
])
def test_bad_arguments_get_one_line_errors(call, message):
    fc1, probs, dinter = _inputs(9, 8)
    with pytest.raises((ValueError, TypeError), match=message) as error:
        call(fc1, probs, dinter)
    assert "\n" not in str(error.value)


# --- GPU: the kernel -------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _compare(fc1, probs, dinter, label):
    """Kernel vs the reference on the same device: bf16/fp16 inter and dfc1 within one ulp
    (the only freedom is where the compiler fuses a multiply-add), dprobs to fp32 summation
    order."""
    inter_k, dfc1_k, dprobs_k = ws.backward(fc1, probs, dinter)
    inter_r, dfc1_r, dprobs_r = ws.reference_backward(fc1, probs, dinter)
    forward_k = ws.forward(fc1, probs)
    assert torch.equal(forward_k, inter_k), "the backward's inter is the forward's"
    report = []
    for name, k, r in (("inter", inter_k, inter_r), ("dfc1", dfc1_k, dfc1_r)):
        equal = (k == r).float().mean().item()
        if fc1.dtype == torch.float32:
            # fp32 outputs: the rounding of an intermediate is as large as the output's, and
            # silu'(g) cancels near g = -1.28, so compare at the tensor's scale instead.
            error = ((k - r).abs().max() / r.abs().max()).item()
            report.append(f"{name} {equal:.4%} bitwise, max {error:.2e} of its max")
            assert error < 1e-6, f"{label}: {name} differs by {error:.2e} of its max"
            continue
        ulps = _ulps(k, r) if not torch.equal(k, r) else 0.0
        report.append(f"{name} {equal:.4%} bitwise, max {ulps:.2f} ulp")
        assert ulps <= 1.0, f"{label}: {name} differs by {ulps} ulp"
    rel = ((dprobs_k.double() - dprobs_r.double()).abs().max()
           / dprobs_r.double().abs().max().clamp_min(1e-30)).item()
    report.append(f"dprobs max relative {rel:.2e}")
    print(f"{label}: " + ", ".join(report))
    assert rel < 1e-5 if probs.dtype == torch.float32 else rel < 1e-2
    # deterministic: the same bits again
    again = ws.backward(fc1, probs, dinter)
    assert all(torch.equal(a, b) for a, b in zip(again, (inter_k, dfc1_k, dprobs_k), strict=True))


@gpu
@needs_cuda
@pytest.mark.parametrize("rows, cols", [(1000, 3072), (257, 1024), (33, 40), (17, 13)],
                         ids=["ffn3072", "ffn1024", "vec-40", "scalar-13"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_the_reference(rows, cols, dtype):
    fc1, probs, dinter = _inputs(rows, cols, dtype, device="cuda")
    _compare(fc1, probs, dinter, f"{dtype} {rows}x{cols}")


@gpu
@needs_cuda
def test_kernel_with_bf16_probs_and_an_unaligned_fc1():
    fc1, probs, dinter = _inputs(64, 256, probs_dtype=torch.bfloat16, device="cuda")
    _compare(fc1, probs, dinter, "bf16 probs")
    # a view starting one element in: not 16-byte aligned, the scalar path takes it
    wide = torch.zeros(64 * 512 + 1, dtype=torch.bfloat16, device="cuda")
    shifted = wide[1:].view(64, 512)
    shifted.copy_(fc1)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(ws.forward(shifted, probs), ws.forward(fc1, probs))


@gpu
@needs_cuda
def test_backward_over_its_inputs_gives_the_same_bits():
    fc1, probs, dinter = _inputs(300, 3072, device="cuda")
    expected = ws.backward(fc1, probs, dinter)
    for over_fc1, over_dinter in ((True, False), (False, True), (True, True)):
        own_fc1, own_dinter = fc1.clone(), dinter.clone()
        inter, dfc1, dprobs = ws.backward(own_fc1, probs, own_dinter, dfc1_over_fc1=over_fc1,
                                          inter_over_dinter=over_dinter)
        assert (dfc1.data_ptr() == own_fc1.data_ptr()) == over_fc1
        assert (inter.data_ptr() == own_dinter.data_ptr()) == over_dinter
        for a, b in zip((inter, dfc1, dprobs), expected, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dfc1_over_fc1 needs a contiguous tensor"):
        ws.backward(fc1.t().contiguous().t(), probs, dinter, dfc1_over_fc1=True)


@gpu
@needs_cuda
def test_empty_buffers_launch_nothing():
    fc1, probs, dinter = _inputs(0, 64, device="cuda")
    inter, dfc1, dprobs = ws.backward(fc1, probs, dinter)
    assert inter.shape == (0, 64) and dfc1.shape == (0, 128) and dprobs.shape == (0,)
    assert ws.forward(fc1, probs).shape == (0, 64)


@gpu
@needs_cuda
def test_kernels_replay_in_a_cuda_graph():
    fc1, probs, dinter = _inputs(512, 1024, device="cuda")
    eager = ws.backward(fc1, probs, dinter)
    ws.forward(fc1, probs)  # builds and loads the extension outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = ws.backward(fc1, probs, dinter)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = _inputs(512, 1024, device="cuda", seed=5)
    for target, source in zip((fc1, probs, dinter), fresh, strict=True):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    expected = ws.backward(*fresh)
    for a, b in zip(captured, expected, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(captured[1], eager[1])  # the replay computed on the new inputs
