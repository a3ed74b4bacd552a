"""TinyMoE (the demo's model): routing into expert segments, the capacity-buffer autograd
functions against plain autograd, the grouped GEMM paths, seeding, and a sync-free forward."""

from __future__ import annotations

import pytest
import torch

from megatron_paging.demo.model import (
    Combine,
    Dispatch,
    ExpertMLP,
    TinyMoE,
    TinyMoEConfig,
    grouped_mm,
    grouped_weight_grad,
    route,
    synthetic_batches,
)


def test_route_fills_expert_segments_in_choice_order():
    generator = torch.Generator().manual_seed(3)
    tokens, experts, topk, capacity = 40, 4, 2, 12
    ids = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)])
    routing = route(ids, experts, capacity)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert torch.equal(routing.live_rows, counts.clamp(max=capacity))
    kept = routing.slot[routing.keep]
    assert kept.unique().numel() == kept.numel()  # no two assignments share a row
    assert int(routing.row_live.sum()) == kept.numel()
    for t, k in routing.keep.nonzero().tolist():
        row = int(routing.slot[t, k])
        assert routing.row_live[row]
        assert (int(routing.row_token[row]), int(routing.row_choice[row])) == (t, k)
        assert row // capacity == ids[t, k]
    # First choices have priority: a dropped first choice implies a full expert of first choices.
    for t in (~routing.keep[:, 0]).nonzero().flatten().tolist():
        expert = int(ids[t, 0])
        assert int((ids[:, 0] == expert).sum()) > capacity


def _masked_reference(x, w1, w2, probs, routing):
    """The MoE block with plain autograd ops (no paging), for gradient comparison."""
    rows = torch.where(routing.row_live[:, None], x[routing.row_token], 0)
    segs = routing.segments
    act = torch.cat(
        [torch.nn.functional.gelu(rows[s : s + n] @ w1[e]) for e, (s, n) in enumerate(segs)]
    )
    y = torch.cat([act[s : s + n] @ w2[e] for e, (s, n) in enumerate(segs)])
    picked = y[routing.slot]
    return torch.where(routing.keep[..., None], picked * probs[..., None], 0).sum(1)


def test_autograd_functions_match_plain_autograd():
    generator = torch.Generator().manual_seed(5)
    tokens, hidden, ffn, experts, topk = 24, 8, 16, 4, 2
    x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(
        experts, hidden, ffn, generator=generator, dtype=torch.float64, requires_grad=True
    )
    w2 = torch.randn(
        experts, ffn, hidden, generator=generator, dtype=torch.float64, requires_grad=True
    )
    probs = torch.rand(tokens, topk, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)])
    routing = route(ids, experts, capacity=8)  # some assignments are dropped
    assert not bool(routing.keep.all())
    grad_out = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)

    rows = Dispatch.apply(x, routing.slot, routing.keep, routing.row_token, routing.row_live)
    y = ExpertMLP.apply(rows, w1, w2, routing, "loop", None)
    out = Combine.apply(y, probs, routing, None)
    got = torch.autograd.grad(out, (x, w1, w2, probs), grad_out)
    want_out = _masked_reference(x, w1, w2, probs, routing)
    want = torch.autograd.grad(want_out, (x, w1, w2, probs), grad_out)
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_grouped_mm_paths_agree():
    generator = torch.Generator().manual_seed(7)
    segments = tuple((e * 16, 16) for e in range(3))
    x = torch.randn(48, 8, generator=generator)
    w = torch.randn(3, 8, 24, generator=generator)
    grad = torch.randn(48, 24, generator=generator)
    torch.testing.assert_close(
        grouped_mm(x, w, segments, "grouped_mm"), grouped_mm(x, w, segments, "loop")
    )
    torch.testing.assert_close(
        grouped_weight_grad(x, grad, segments, "grouped_mm"),
        grouped_weight_grad(x, grad, segments, "loop"),
    )
    torch.testing.assert_close(grouped_mm(x, w, segments, "loop")[16:32], x[16:32] @ w[1])


def test_model_is_deterministic_and_seeded():
    cfg = TinyMoEConfig(hidden=16, ffn=32, layers=1, experts=4)
    tokens, targets = synthetic_batches(cfg.vocab, 2, 16, 1, seed=1)[0]
    a, b, c = TinyMoE(cfg, seed=1), TinyMoE(cfg, seed=1), TinyMoE(cfg, seed=2)
    assert torch.equal(a(tokens, targets), b(tokens, targets))
    assert not torch.equal(a.layers[0].moe.w1, c.layers[0].moe.w1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_is_sync_free(tmp_path):
    cfg = TinyMoEConfig(hidden=64, ffn=128, layers=2, experts=8)
    model = TinyMoE(cfg).cuda().bfloat16()
    tokens, targets = (t.cuda() for t in synthetic_batches(cfg.vocab, 2, 64, 1, seed=0)[0])
    model(tokens, targets)  # warm-up (lazy initialization may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")


