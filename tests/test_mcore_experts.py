"""PagedGroupedMLP on CPU: forward/backward against a dense per-expert reference, for both GEMM
backends; and paged vs unpaged inside a real Megatron-Core MoELayer (bitwise identical)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from mcore_fixtures import cpu_moe_layer, installed, model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.mcore.experts import (  # noqa: E402
    PagedGroupedMLP,
    _zero_empty_experts,
    resolve_gemm_backend,
)

HIDDEN, FFN = 32, 48


def _dense_reference(module, x, tokens_per_expert, probs):
    """Each expert as plain autograd matmuls over its own rows."""
    outs, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        rows = x[start : start + n]
        fc1 = rows @ module.weight1[e].t()
        if module.config.gated_linear_unit:
            a, b = fc1.chunk(2, dim=-1)
            act = module.config.activation_func(a) * b
        else:
            act = module.config.activation_func(fc1)
        outs.append((act * probs[start : start + n, None]) @ module.weight2[e].t())
        start += n
    return torch.cat(outs)


def _inputs(seed, tokens_per_expert, capacity):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(capacity, HIDDEN, generator=gen)
    probs = torch.rand(capacity, generator=gen)
    return x, torch.tensor(tokens_per_expert), probs


@pytest.mark.parametrize("gemm_backend", ["loop", "grouped"])
@pytest.mark.parametrize("gated", [True, False])
def test_forward_backward_match_dense_reference(installed, model_parallel, gemm_backend, gated):  # noqa: F811
    torch.manual_seed(0)
    activation = F.silu if gated else F.gelu
    config = moe_config(
        hidden_size=HIDDEN,
        moe_ffn_hidden_size=FFN,
        gated_linear_unit=gated,
        activation_func=activation,
    )
    module = PagedGroupedMLP(4, config, gemm_backend=gemm_backend)
    counts = [5, 0, 7, 3]
    live = sum(counts)
    x, tpe, probs = _inputs(1, counts, capacity=24)
    x1, p1 = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = module(x1, tpe, p1)
    assert bias is None and out.shape == (24, HIDDEN)
    grad = torch.randn(live, HIDDEN, generator=torch.Generator().manual_seed(2))
    (out[:live] * grad).sum().backward()
    w1_grad, w2_grad = module.weight1.grad.clone(), module.weight2.grad.clone()
    module.zero_grad()

    x2, p2 = x.clone().requires_grad_(), probs.clone().requires_grad_()
    ref = _dense_reference(module, x2, tpe, p2)
    (ref * grad).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:live], ref, **tol)
    torch.testing.assert_close(x1.grad[:live], x2.grad[:live], **tol)
    torch.testing.assert_close(p1.grad[:live], p2.grad[:live], **tol)
    torch.testing.assert_close(w1_grad, module.weight1.grad, **tol)
    torch.testing.assert_close(w2_grad, module.weight2.grad, **tol)
    assert module.weight1.allreduce is False and module.weight2.allreduce is False


@pytest.mark.parametrize("gemm_backend", ["loop", "grouped"])
def test_fc2_dgrad_runs_before_fc1_is_unpacked(installed, model_parallel, monkeypatch,  # noqa: F811
                                               gemm_backend):
    """An offloaded fc1's unpack makes the compute stream wait for its reload: the fc2 dgrad
    GEMM, which does not read fc1, is issued before it, so it runs beside the copy."""
    from megatron_paging.mcore import experts

    config = moe_config(hidden_size=HIDDEN, moe_ffn_hidden_size=FFN)
    module = PagedGroupedMLP(4, config, gemm_backend=gemm_backend)
    x, tpe, probs = _inputs(3, [5, 0, 7, 3], capacity=24)
    events, real_gmm = [], experts._gmm
    monkeypatch.setattr(experts, "_gmm", lambda a, b, *r: (
        events.append(("gmm", tuple(a.shape), tuple(b.shape))), real_gmm(a, b, *r))[1])
    fc1_shape = (24, 2 * FFN if config.gated_linear_unit else FFN)

    def unpack(t):
        if tuple(t.shape) == fc1_shape:
            events.append(("unpack fc1",))
        return t

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        out, _ = module(x.requires_grad_(), tpe, probs.requires_grad_())
    events.clear()
    out.sum().backward()
    # backward: fc2 dgrad (dout [24, H] x w2 [E, H, F]), then fc1 comes back, then the rest
    assert events[0] == ("gmm", (24, HIDDEN), tuple(module.weight2.shape))
    assert events[1] == ("unpack fc1",)
    assert len([e for e in events if e[0] == "gmm"]) == 4  # fc2 dgrad/wgrad, fc1 wgrad/dgrad


def test_gemm_backend_choice_and_errors(installed, model_parallel):  # noqa: F811
    assert resolve_gemm_backend("auto", torch.zeros(2, 2)) == "loop"  # CPU: per-expert loop
    assert resolve_gemm_backend("grouped", torch.zeros(2, 2)) == "grouped"
    with pytest.raises(ValueError, match="gemm_backend must be one of"):
        resolve_gemm_backend("cublas", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="does not support add_bias_linear=True"):
        PagedGroupedMLP(4, moe_config(add_bias_linear=True))


def test_delayed_wgrad_is_rejected(installed, model_parallel):  # noqa: F811
    config = moe_config()
    # Megatron-Core validates delay_wgrad_compute against features the CPU test lacks (EP
    # overlap, TE), so it is set on a built config, as an already-validated run would have it.
    config.delay_wgrad_compute = True
    with pytest.raises(ValueError, match="does not support delay_wgrad_compute=True") as error:
        PagedGroupedMLP(4, config)
    assert "\n" not in str(error.value)


def _moe_layer(config):
    return cpu_moe_layer(config)


def _train_steps(api, layer, config, paged: bool, steps: int = 3):
    """Forward/backward of ``layer`` over ``steps`` steps of two microbatches each."""
    config.moe_paged_stash = paged
    results = []
    for step in range(steps):
        layer.zero_grad()
        if paged:
            api.paged_stash_reset(enabled=True, config=config)
        losses, outputs = [], []
        for micro in range(2):  # both forwards first, then both backwards (pages in flight)
            if paged:
                api.paged_stash_init_chunk_handler(None, None)
            gen = torch.Generator().manual_seed(100 * step + micro)
            hidden = torch.randn(8, 2, config.hidden_size, generator=gen).requires_grad_()
            out, _ = layer(hidden)
            outputs.append((hidden, out))
        for _hidden, out in reversed(outputs):
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        results.append((losses, grads, [h.grad.clone() for h, _ in outputs]))
    return results


def test_moe_layer_paged_matches_unpaged_bitwise(installed, model_parallel):  # noqa: F811
    api = installed
    torch.manual_seed(0)
    config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)
    layer = _moe_layer(config)
    assert type(layer.experts).__name__ == "PagedGroupedMLP"
    assert type(layer.token_dispatcher).__name__ == "PagingFlexTokenDispatcher"

    unpaged = _train_steps(api, layer, config, paged=False)
    paged = _train_steps(api, layer, config, paged=True)
    # The last step ran through the scheduler's CPU backend: stashes in forward order (both
    # records of microbatch 1, then of 2), reloads in backward order (2 before 1), and every
    # launch carries its slot annotation.
    log = api.engine.scheduler.backend
    stashes = [(e.info["layer"], e.info["microbatch"]) for e in log.entries("launch", "stash")]
    reloads = [(e.info["layer"], e.info["microbatch"]) for e in log.entries("launch", "reload")]
    assert stashes[-4:] == [(0, 1), (0, 1), (0, 2), (0, 2)]
    assert reloads[-4:] == [(0, 2), (0, 2), (0, 1), (0, 1)]
    assert api.engine.mode == "paged" and len(api.engine.pools) == 2  # x and fc1 row sizes
    for pool in api.engine.pools:  # every page came back after backward
        assert pool.free_pages() == (pool.num_cuda_pages, pool.num_host_pages)
    assert not bool(api.check_paged_stash_overflow())
    for (l_u, g_u, h_u), (l_p, g_p, h_p) in zip(unpaged, paged, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l_u, l_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(g_u, g_p, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(h_u, h_p, strict=True))
    api.paged_stash_reset(enabled=False, config=config)


def test_undersized_pool_sets_overflow(installed, model_parallel):  # noqa: F811
    api = installed
    torch.manual_seed(0)
    config = moe_config(
        moe_paged_stash=True,
        moe_expert_rank_capacity_factor=2.0,
        moe_paged_stash_page_size=4,
        moe_paged_stash_buffer_size_factor_cuda=0.25,
    )
    layer = _moe_layer(config)
    api.engine.release_pools()
    _train_steps(api, layer, config, paged=True, steps=2)  # calibrate, then a too-small pool
    assert bool(api.check_paged_stash_overflow())
    api.engine.release_pools()
    api.paged_stash_reset(enabled=False, config=config)


@pytest.fixture
def nan_filled_empty():
    """Deterministic mode fills torch.empty with NaN: rows past a live prefix become poison."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_rows_past_live_never_reach_results(installed, model_parallel, nan_filled_empty):  # noqa: F811
    api = installed
    assert torch.empty(4).isnan().all()
    torch.manual_seed(1)
    config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)
    layer = _moe_layer(config)
    api.engine.release_pools()
    unpaged = _train_steps(api, layer, config, paged=False)
    paged = _train_steps(api, layer, config, paged=True)
    for (l_u, g_u, h_u), (l_p, g_p, h_p) in zip(unpaged, paged, strict=True):
        for a, b in zip(l_u + g_u + h_u, l_p + g_p + h_p, strict=True):
            assert torch.isfinite(b).all() and torch.equal(a, b)
    api.paged_stash_reset(enabled=False, config=config)


def _calibrated_paged_layer(api, seed: int):
    """A fresh paged MoE layer whose pools one step has calibrated."""
    torch.manual_seed(seed)
    config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)
    layer = _moe_layer(config)
    api.engine.release_pools()
    _train_steps(api, layer, config, paged=True, steps=1)  # calibrate
    return layer, config


def test_reloaded_tensors_are_freed_when_their_backward_ran(installed, model_parallel, monkeypatch):  # noqa: F811
    import weakref

    from megatron_paging.runtime.saved import Saved

    api = installed
    layer, config = _calibrated_paged_layer(api, seed=2)
    reloaded = []
    unpack = api.context.unpack

    def tracking_unpack(saved):
        paged = isinstance(saved, Saved) and saved.handle is not None  # not a weight or probs
        tensor = unpack(saved)
        if paged:
            reloaded.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(api.context, "unpack", tracking_unpack)
    api.paged_stash_reset(enabled=True, config=config)
    api.paged_stash_init_chunk_handler(None, None)
    hidden = torch.randn(8, 2, config.hidden_size).requires_grad_()
    out, _ = layer(hidden)
    out.float().square().mean().backward()
    assert api.engine.mode == "paged" and len(reloaded) == 2  # x and fc1
    assert out.grad_fn is not None  # the graph is still alive ...
    assert all(ref() is None for ref in reloaded)  # ... but the reloaded buffers are gone
    api.paged_stash_reset(enabled=False, config=config)


def test_stashed_buffers_are_freed_before_their_backward(installed, model_parallel, monkeypatch):  # noqa: F811
    """Forward side of the above: once microbatch 1's stash is retired (at microbatch 2's commit)
    nothing holds its capacity buffers — they live in pages until the reload. Holding them (a
    mark on the saved tensor could) would make paging cost the pool on top of them."""
    import gc
    import weakref

    api = installed
    layer, config = _calibrated_paged_layer(api, seed=3)
    stashed = []
    pack_marked = api.context.pack_marked

    def tracking_pack_marked(tensor, *args, **kwargs):
        stashed.append(weakref.ref(tensor))
        return pack_marked(tensor, *args, **kwargs)

    monkeypatch.setattr(api.context, "pack_marked", tracking_pack_marked)
    api.paged_stash_reset(enabled=True, config=config)
    outputs = []
    for micro in range(2):
        api.paged_stash_init_chunk_handler(None, None)
        gen = torch.Generator().manual_seed(micro)
        hidden = torch.randn(8, 2, config.hidden_size, generator=gen).requires_grad_()
        outputs.append(layer(hidden)[0])
    gc.collect()
    assert api.engine.mode == "paged" and len(stashed) == 4  # x and fc1 of each microbatch
    assert all(ref() is None for ref in stashed[:2])  # microbatch 1's, retired at 2's commit
    for out in reversed(outputs):
        out.float().square().mean().backward()
    assert api.paged_stash_finish() == 0
    api.paged_stash_reset(enabled=False, config=config)


def test_experts_without_tokens_get_zero_gradients_in_place():
    # grouped_mm leaves an expert without rows unwritten (any bytes, NaN included): zeroed in
    # place, every other expert's gradient bit for bit, no second gradient allocated
    dw = torch.randn(4, 3, 2)
    dw[1] = float("nan")
    dw[3] = float("inf")
    kept = dw.clone()
    offs = torch.tensor([5, 5, 9, 9], dtype=torch.int32)  # experts 1 and 3 have no rows
    out = _zero_empty_experts(dw, offs)
    assert out is dw
    assert torch.equal(out[1], torch.zeros(3, 2)) and torch.equal(out[3], torch.zeros(3, 2))
    assert torch.equal(out[0], kept[0]) and torch.equal(out[2], kept[2])
