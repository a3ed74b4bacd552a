"""The demo: TinyMoE routing and autograd functions, the saved-tensor paging hooks, the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_paging import kernels
from megatron_paging.cli import build_parser
from megatron_paging.demo import cli as demo_cli
from megatron_paging.demo.hooks import HeldTensor, PagedTensor, SavedTensorPaging
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
from megatron_paging.pool import PagePools

SMALL = [
    "--device",
    "cpu",
    "--steps",
    "2",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--experts",
    "4",
    "--seq",
    "32",
    "--batch",
    "2",
    "--page-size",
    "8",
]


def demo_args(tmp_path, *extra):
    return build_parser().parse_args(["demo", *SMALL, "--plot", str(tmp_path / "p.png"), *extra])


def table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step |"))
    rows = []
    for line in lines[start + 2 :]:
        if "|" not in line:
            break
        rows.append([cell.strip() for cell in line.split("|")])
    return rows


def kib(cell: str) -> float:
    assert cell.endswith(" KiB"), cell
    return float(cell[:-4])


# -- the demo end to end ---------------------------------------------------------------------


def test_demo_bitwise_parity_plot_and_memory(tmp_path, capsys):
    args = demo_args(tmp_path)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "parity: bitwise"
    png = tmp_path / "p.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png.resolve()}" in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "2"]
    for row in rows:
        assert row[1] == row[2] and row[3] == row[4]  # printed losses / grad norms agree
        assert kib(row[6]) < kib(row[5])  # paged holds fewer bytes than control
        assert int(row[7]) > 0 and row[8] == "0" and row[9] == "0"


def test_reload_destinations_poisoned_with_nan_keep_parity(tmp_path, capsys):
    # Non-live rows of a reloaded buffer are NaN: the model must never let them reach a result.
    result = demo_cli.run_demo(demo_args(tmp_path), reload_fill=math.nan)
    assert result.bitwise, result.mismatches
    for step in result.paged:
        assert step.stats.pages_in_use_after == 0  # every page came back
        assert all(torch.isfinite(g).all() for g in step.grads.values())


def test_corrupted_reload_is_reported_as_mismatch(tmp_path, capsys, monkeypatch):
    real_reload = kernels.reload

    def flip_one_byte(dst, record, pool, backend="auto", max_ctas=None):
        real_reload(dst, record, pool, backend, max_ctas)
        segment = int(torch.nonzero(record.live_rows > 0)[0, 0])  # a live row: it matters
        offset = record.segment_starts[segment] * record.row_bytes + 3  # an fp32 exponent byte
        dst.view(-1).view(torch.uint8)[offset] ^= 0x40

    monkeypatch.setattr(kernels, "reload", flip_one_byte)
    args = demo_args(tmp_path)
    assert args.func(args) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("parity: MISMATCH ") and "gradient(s) differ" in last


def test_pool_overflow_is_reported(tmp_path, capsys):
    args = demo_args(tmp_path, "--pool-factor", "0.3")
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "overflow" in out.splitlines()[-1]
    assert [r[9] for r in table_rows(out)] == ["1", "1"]


def test_host_tier_absorbs_what_the_device_tier_cannot(tmp_path):
    result = demo_cli.run_demo(
        demo_args(tmp_path, "--pool-factor", "0.3", "--host-pool-factor", "1.0")
    )
    assert result.bitwise, result.mismatches
    assert all(step.stats.host_spills > 0 for step in result.paged)
    assert all(not step.stats.overflow for step in result.paged)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--pool-factor", "0"], "--pool-factor"),
        (["--host-pool-factor", "-1"], "--host-pool-factor"),
        (["--kernel-backend", "triton"], "--kernel-backend"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--topk", "5"], "--topk"),
        (["--kernel-backend", "cuda"], "--kernel-backend"),
    ],
)
def test_bad_combinations_give_one_line_errors(tmp_path, capsys, extra, flag):
    args = demo_args(tmp_path, *extra)
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and flag in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda(tmp_path, capsys):
    args = build_parser().parse_args(["demo", "--device", "cuda"])
    assert args.func(args) == 2
    assert "--device cuda" in capsys.readouterr().err


# -- routing and the capacity-buffer autograd functions ----------------------------------------


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


# -- the hooks ------------------------------------------------------------------------------


def test_only_marked_tensors_are_paged():
    pools = PagePools(page_size=4)
    pools.add(row_bytes=16, cuda_rows=16)
    paging = SavedTensorPaging(pools)
    live = torch.tensor([5, 2])
    marked = torch.arange(40, dtype=torch.float32).view(10, 4)
    twin = marked.clone()  # same shape and dtype, not marked
    paging.mark(marked, live, [(0, 6), (6, 4)])
    handle = paging.pack(marked)
    assert isinstance(handle, PagedTensor)
    assert pools[16].free_pages() == (1, 0)  # 2 pages for 5 live rows + 1 page for 2
    head, shifted = marked[:5], marked[1:]  # same address or same storage, other shapes
    for other in (twin, head, shifted):
        assert paging.pack(other) is other
    reloaded = paging.unpack(handle)
    assert reloaded.shape == marked.shape and reloaded is paging.unpack(handle)
    assert torch.equal(reloaded[:5], marked[:5]) and torch.equal(reloaded[6:8], marked[6:8])
    assert pools[16].free_pages() == (4, 0)


def test_dead_mark_does_not_match_a_new_tensor_at_its_address():
    paging = SavedTensorPaging(page_size=4, track_bytes=True)
    doomed = torch.zeros(8, 4)
    paging.mark(doomed, torch.tensor(3))
    del doomed
    newcomer = torch.ones(8, 4)  # may well reuse the freed address
    handle = paging.pack(newcomer)
    assert isinstance(handle, HeldTensor) and handle.marked is None


def test_control_mode_measures_page_rounded_live_rows():
    paging = SavedTensorPaging(page_size=4, track_bytes=True)
    x = torch.randn(16, 3, requires_grad=True)
    live = torch.tensor([5, 0, 4])
    with paging:
        y = x * 2
        paging.mark(y, live, [(0, 8), (8, 4), (12, 4)])
        loss = (y * y).sum()  # saves y (twice: as both operands)
    assert paging.peak_rows == {12: 2 * (8 + 0 + 4)}
    loss.backward()
    del loss
    assert paging._rows_in_flight == {12: 0}
    assert paging.timeline.capacity_bytes[-1] == 0


def test_model_is_deterministic_and_seeded():
    cfg = TinyMoEConfig(hidden=16, ffn=32, layers=1, experts=4)
    tokens, targets = synthetic_batches(cfg.vocab, 2, 16, 1, seed=1)[0]
    a, b, c = TinyMoE(cfg, seed=1), TinyMoE(cfg, seed=1), TinyMoE(cfg, seed=2)
    assert torch.equal(a(tokens, targets), b(tokens, targets))
    assert not torch.equal(a.layers[0].moe.w1, c.layers[0].moe.w1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_is_sync_free_and_demo_bitwise(tmp_path, capsys):
    cfg = TinyMoEConfig(hidden=64, ffn=128, layers=2, experts=8)
    model = TinyMoE(cfg).cuda().bfloat16()
    tokens, targets = (t.cuda() for t in synthetic_batches(cfg.vocab, 2, 64, 1, seed=0)[0])
    model(tokens, targets)  # warm-up (lazy initialization may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    args = build_parser().parse_args(
        ["demo", "--device", "cuda", "--steps", "3", "--plot", str(tmp_path / "p.png")]
    )
    assert args.func(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "parity: bitwise"
