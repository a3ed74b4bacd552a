"""The paged offloading backend inside real Megatron-Core modules on the CPU (reference kernels,
CPU stream backend): a TransformerLayer with MoE experts, every module set offloaded, bitwise
equal to the run without offloading, also under a simulated capture; the groups the offload plan
keeps; views; the installer's rebinding (start-up flags, the plan's knobs and the lifts:
test_mcore_offload_startup.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytest.importorskip("megatron.training")

from mcore_fixtures import model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.config import PagingConfig  # noqa: E402

DENSE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
EXPERTS = ["expert_fc1", "moe_act"]
PAGE = 4


@pytest.fixture(scope="module")
def offload_installed():
    from megatron_paging.mcore.api import MCorePagingAPI
    from megatron_paging.mcore.installer import PagingInstaller
    from megatron_paging.runtime.engine import PagingEngine
    from megatron_paging.runtime.streams import CpuStreamBackend

    installer = PagingInstaller()
    config = PagingConfig(page_size=PAGE, kernel_backend="reference")
    api = MCorePagingAPI(PagingEngine(config, stream_backend=CpuStreamBackend()))
    api = installer.install(api=api, offload_backend="paged")
    try:
        yield installer, api
    finally:
        installer.uninstall()


@pytest.fixture
def cpu_router(monkeypatch):
    """Megatron's TopKRouter.gating moves its weight to CUDA; gate on the CPU instead."""
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(
        TopKRouter, "gating", lambda self, x: F.linear(x.float(), self.weight.float())
    )


def _layer(modules, paged_stash, recompute_fc1=False):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_paging.mcore.specs import get_gpt_moe_paged_layer_spec

    config = moe_config(
        fine_grained_activation_offloading=True, offload_modules=list(modules),
        min_offloaded_tensor_size=128, moe_paged_stash=paged_stash, normalization="RMSNorm",
        attention_dropout=0.0, hidden_dropout=0.0, moe_paged_stash_page_size=PAGE,
        moe_expert_rank_capacity_factor=2.0,
    )
    torch.manual_seed(0)
    spec = get_gpt_moe_paged_layer_spec(4, normalization="RMSNorm", core_attention="sdpa",
                                        recompute_expert_fc1=recompute_fc1)
    return build_module(spec, config=config, layer_number=1), config


def _train(api, layer, config, offload: bool, steps: int = 3, fraction: float = 1.0):
    """``steps`` steps of two microbatches: both forwards, then both backwards
    (``fraction``: Megatron's --activation-offload-fraction)."""
    manager = api.offload
    manager.enabled = offload
    stash = config.moe_paged_stash
    results = []
    for step in range(steps):
        layer.zero_grad()
        if stash:
            api.paged_stash_reset(enabled=True, config=config)
        outputs = []
        for micro in range(2):
            manager.init_chunk_handler(0, None, None, config.min_offloaded_tensor_size, 0,
                                       fraction)
            if stash:
                api.paged_stash_init_chunk_handler(None, None)
            gen = torch.Generator().manual_seed(100 * step + micro)
            hidden = torch.randn(8, 2, config.hidden_size, generator=gen).requires_grad_()
            out, _ = layer(hidden, attention_mask=None)
            outputs.append((hidden, out))
        losses = []
        for _, out in reversed(outputs):
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        assert api.paged_stash_finish() == 0
        grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        results.append((losses, grads, [h.grad.clone() for h, _ in outputs]))
    return results


@pytest.mark.parametrize(
    ("modules", "paged_stash", "dma_prefix"),
    [
        (EXPERTS, False, 0.0), (EXPERTS, False, 1.0), (DENSE, False, 0.0),
        (DENSE + EXPERTS, False, 0.0), (DENSE + EXPERTS, True, 0.0), (DENSE + EXPERTS, True, 0.5),
        (DENSE + ["moe_act"], True, 0.0),
    ],
    ids=["experts", "experts+dma-prefix", "dense", "both", "both+paged-stash",
         "both+paged-stash+dma-prefix", "dense+moe_act+paged-stash"],
)
def test_offloaded_layer_is_bitwise_equal_to_no_offload(
    offload_installed, model_parallel, cpu_router, modules, paged_stash, dma_prefix  # noqa: F811
):
    _, api = offload_installed
    api.engine.configure(api.engine.config.replace(offload_dma_prefix=dma_prefix))
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    layer, config = _layer(modules, paged_stash)
    config.moe_paged_stash = False
    control = _train(api, layer, config, offload=False)
    config.moe_paged_stash = paged_stash
    api.engine.release_pools()
    engine_log(api).clear()
    offloaded = _train(api, layer, config, offload=True)
    for (l_c, g_c, h_c), (l_o, g_o, h_o) in zip(control, offloaded, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l_c, l_o, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(g_c, g_o, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(h_c, h_o, strict=True))

    engine = api.engine
    assert engine.mode == "paged" and engine.offload_pools is not None
    launches = [e for e in engine_log(api) if e.op == "launch"]
    kinds = {e.info["offload"] for e in launches if e.kind == "stash"}
    expect = {"rows"} if set(modules) & set(EXPERTS) else set()
    expect |= {"whole"} if set(modules) & set(DENSE) else set()
    assert kinds - {None} == expect
    # The stash pages the expert tensors no group offloads (x next to moe_act), on the device
    # tier; with both expert groups offloaded it has nothing left to page.
    assert (None in kinds) == (paged_stash and "expert_fc1" not in modules)
    for pool in engine.offload_pools.pools:  # every host page came back
        assert pool.free_pages() == (0, pool.num_host_pages)
    assert engine.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}
    if "expert_fc1" in modules:
        # Only live rows cross: the host pages of the last step's records hold at most the live
        # rows rounded up to pages (the capacity buffers are 2x the tokens routed).
        rows = [e for e in launches if e.kind == "stash" and e.info["offload"] == "rows"]
        assert rows and all(e.info["pool_key"] in (128, 384) for e in rows)
        # With a prefix, every live-row record's first rows went by the copy engine.
        assert all((e.info["prefix_rows"] > 0) == (dma_prefix > 0) for e in rows)
        # What the example reports for the last step: every routed row at most once, against
        # capacity buffers sized 2x the routed rows (so at most half of their bytes).
        live, capacity = api.offload.rows_live_bytes(), api.offload.offloaded_bytes["rows_capacity"]
        assert 0 < 2 * live <= capacity


@pytest.mark.parametrize("paged_stash", [False, True], ids=["offload", "offload+paged-stash"])
def test_recomputed_fc1_offloads_only_the_input_and_matches_the_saving_control(
    offload_installed, model_parallel, cpu_router, paged_stash  # noqa: F811
):
    """--paging-recompute-expert-fc1 with expert_fc1 offloaded: one live-row record per layer
    and microbatch (x's row size), bitwise equal to the experts that save fc1, not offloaded."""
    _, api = offload_installed
    api.engine.configure(api.engine.config.replace(offload_dma_prefix=0.0))
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    layer, config = _layer(DENSE, False)
    config.fine_grained_activation_offloading = False
    control = _train(api, layer, config, offload=False)
    layer, config = _layer(DENSE + ["expert_fc1"], paged_stash, recompute_fc1=True)
    api.engine.release_pools()
    engine_log(api).clear()
    offloaded = _train(api, layer, config, offload=True)
    assert _bitwise(offloaded, control)
    launches = [e for e in engine_log(api) if e.op == "launch" and e.kind == "stash"]
    rows = [e for e in launches if e.info["offload"] == "rows"]
    assert rows and {e.info["pool_key"] for e in rows} == {config.hidden_size * 4}  # x only
    assert not any(e.info["offload"] is None for e in launches)  # nothing left to stash


def engine_log(api):
    """The log of the CPU stream backend the fixture gave the engine."""
    return api.engine._stream_backend.log


def test_groups_the_plan_keeps_stay_on_the_device(offload_installed, model_parallel, cpu_router,  # noqa: F811
                                                  monkeypatch):
    from megatron_paging.runtime.sources import SourceLifetimes

    _, api = offload_installed
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    layer, config = _layer(DENSE, False)
    _train(api, layer, config, offload=True, steps=2)
    plan = api.offload.plan
    # Both forwards, then both backwards: the second microbatch's backward follows its forward
    # at once, so the margin keeps its last group of each name (each name occurs once).
    assert plan is not None and plan.kept == {(0, 2, i) for i in range(len(DENSE))}
    # Each kept group's end closes its name's in-flight window in the scheduler (what lets a
    # capture drop that name's offload sources before the forward's end).
    closed = []
    monkeypatch.setattr(SourceLifetimes, "close_offload_window",
                        lambda self, chunk, name, mb: closed.append((chunk, name, mb)))
    _train(api, layer, config, offload=True, steps=1)
    assert sorted(closed) == sorted((0, name, 2) for name in DENSE)


def test_a_kept_group_above_offloaded_ones_prefetches_them(offload_installed, model_parallel,  # noqa: F811
                                                          cpu_router, monkeypatch):
    from megatron_paging.runtime.scheduler import PagingScheduler

    _, api = offload_installed
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    layer, config = _layer(DENSE + EXPERTS, False)
    control = _train(api, layer, config, offload=False, steps=1)
    # --activation-offload-fraction 0.5 keeps the later half of microbatch 1's groups too
    # (forward order: attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act).
    _train(api, layer, config, offload=True, steps=2, fraction=0.5)
    kept = api.offload.plan.kept
    assert {(0, 1, i) for i in (4, 5, 6)} <= kept and (0, 1, 3) not in kept
    prefetched, reasons = [], []
    real_prefetch, real_reload = PagingScheduler.prefetch, PagingScheduler._reload
    monkeypatch.setattr(PagingScheduler, "prefetch", lambda self, chunk, mb, *a, **k: (
        prefetched.append((chunk, mb)), real_prefetch(self, chunk, mb, *a, **k))[1])
    monkeypatch.setattr(PagingScheduler, "_reload", lambda self, handles, reason, *a, **k: (
        reasons.append((reason, len(handles))), real_reload(self, handles, reason, *a, **k))[1])
    results = _train(api, layer, config, offload=True, steps=1, fraction=0.5)
    # Microbatch 1: mlp_norm (4) is the lowest kept group and attn_proj (3) below it is
    # offloaded, so mlp_norm's backward reloads attn_proj's group ahead of attn_proj's own
    # backward (its first reload: nothing is reloaded on demand). Microbatch 2 keeps every
    # group, and the one kept above nothing offloaded prefetches nothing.
    assert prefetched == [(0, 1)]
    assert reasons and reasons[0][0] == "prefetch" and "demand" not in dict(reasons)
    assert _bitwise(results, control)


def _bitwise(results, control) -> bool:
    return all(
        all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for (*got_step,), (*want_step,) in zip(results, control, strict=True)
        for got, want in zip(got_step, want_step, strict=True)
    )


def test_installer_rebinds_the_interface_and_restores_it(offload_installed):
    installer, api = offload_installed
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgao
    from megatron.core.transformer import attention

    assert attention.off_interface is fgao.FineGrainedActivationOffloadingInterface
    assert attention.off_interface.manager is api.offload
    from megatron_paging.mcore.installer import PagingInstaller

    other = PagingInstaller()
    installer.uninstall()
    try:
        assert attention.off_interface.__name__ == "FineGrainedActivationOffloadingInterface"
        with pytest.raises(ValueError, match="replace_paged_stash"):
            other.install(replace_paged_stash=False, offload_backend="paged")
        with pytest.raises(ValueError, match="offload_backend"):
            other.install(offload_backend="te")
    finally:
        installer.install(api=api, offload_backend="paged")


def test_expert_offload_with_paged_stash_is_lifted_for_the_paged_backend_only(offload_installed):
    installer, api = offload_installed
    moe_config(
        moe_paged_stash=True, fine_grained_activation_offloading=True, offload_modules=EXPERTS
    )  # accepted: our backend
    installer.uninstall()
    installer.install(config=PagingConfig(page_size=PAGE, kernel_backend="reference"))
    try:  # installed without an offloading backend: Megatron-Core's check stands
        with pytest.raises(ValueError, match="paged stash covers"):
            moe_config(
                moe_paged_stash=True, fine_grained_activation_offloading=True,
                offload_modules=EXPERTS,
            )
    finally:
        installer.uninstall()
        installer.install(api=api, offload_backend="paged")


# ---------------------------------------------------------------------------- views
def test_views_come_back_with_their_strides():
    from megatron_paging.runtime.saved import StridedView, packable, span

    base = torch.arange(2 * 3 * 12, dtype=torch.float32).reshape(2, 3, 12)
    permuted = base.transpose(0, 1)  # dense: the run it spans is its own storage
    gapped = base[..., 8:]  # v out of a fused qkv: gaps between rows
    assert span(permuted) == permuted.numel() and span(gapped) > gapped.numel()
    assert span(base.expand(4, 2, 3, 12)) is None  # zero stride: overlapping, stays
    assert packable(base.expand(4, 2, 3, 12), rows=False) is None
    assert packable(permuted, rows=True) is None  # a capacity buffer's rows must be rows
    assert packable(base, rows=True) == (base, None)  # contiguous: moved as it is
    for view in (permuted, gapped):
        moved, restore = packable(view, rows=False)
        assert moved.is_contiguous() and restore == StridedView(view.shape, view.stride(),
                                                                span(view))
        back = restore.restore(moved.clone())  # what a reload hands back: a fresh buffer
        assert back.stride() == view.stride() and torch.equal(back, view)
    # dense: the storage run itself is moved; gapped: only the view's own elements
    assert packable(permuted, rows=False)[0].data_ptr() == base.data_ptr()
    assert packable(gapped, rows=False)[0].numel() == gapped.numel()


def test_groups_must_close_innermost_first(offload_installed):
    from megatron.core.transformer import attention

    _, api = offload_installed
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    api.offload.init_chunk_handler(0, None, None, 1, 0, 1.0)  # begins the step (no stash)
    x = torch.randn(8, 8, requires_grad=True)
    outer = attention.off_interface(True, x, "attn_norm")
    with outer:
        y = x * 2
    inner = attention.off_interface(True, y, "qkv_linear")
    with inner:
        z = y * 3
    with pytest.raises(RuntimeError, match="attn_norm"):  # names the group
        outer.group_offload(z)
    inner_out = inner.group_offload(z)  # the innermost closes fine
    api.context.commit_slot()  # the outer slot, whose interface gave up its group
    inner_out.sum().backward()
    assert api.paged_stash_finish() == 0
    assert torch.equal(x.grad, torch.full_like(x, 6.0))


def test_under_capture_forced_releases_wait_for_the_copy_and_stay_bitwise(
    offload_installed, model_parallel, cpu_router, monkeypatch  # noqa: F811
):
    """Megatron's ``forced_released_tensors`` inside a (simulated) capture: not freed at the
    commit (no ``record_stream`` there) but handed to the source lifetimes, which free them after
    the compute stream's wait; the step stays bitwise equal to the one without offloading."""
    from megatron_paging.runtime.sources import SourceLifetimes

    _, api = offload_installed
    api.engine.release_pools()
    api.offload.plan = api.offload.log = None
    layer, config = _layer(DENSE, False)
    control = _train(api, layer, config, offload=False, steps=1)
    _train(api, layer, config, offload=True, steps=2)  # calibration, then the plan's step
    backend = api.engine._stream_backend
    monkeypatch.setattr(backend, "capturing", lambda: True, raising=False)
    handed = []
    free = SourceLifetimes.free_with_sources

    def spy(self, tensors):
        handed.extend(tensors)
        return free(self, tensors)

    monkeypatch.setattr(SourceLifetimes, "free_with_sources", spy)
    captured = _train(api, layer, config, offload=True, steps=1)
    # core_attn's q/k/v, attn_proj's input, the norms' residuals of the offloaded microbatch
    sizes = [t.untyped_storage().size() for t in handed]  # (a freed tensor cannot be printed)
    handed.clear()
    assert sizes and sizes == [0] * len(sizes), sizes
    (l_c, g_c, h_c), (l_o, g_o, h_o) = control[0], captured[0]
    assert all(torch.equal(a, b) for a, b in zip(l_c, l_o, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g_c, g_o, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(h_c, h_o, strict=True))
