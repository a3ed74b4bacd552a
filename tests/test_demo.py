"""The demo: one pipeline rank of TinyMoE through the paging scheduler, calibration, overflow
policies, the CLI contract; and TinyMoE's routing and capacity-buffer autograd functions."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_paging import kernels, overflow
from megatron_paging.cli import build_parser
from megatron_paging.demo import cli as demo_cli
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
from megatron_paging.demo.pipeline import stage_indices

SMALL = [
    "--device", "cpu", "--steps", "3", "--layers", "1", "--hidden", "32", "--experts", "4",
    "--seq", "32", "--batch", "2", "--page-size", "8", "--microbatches", "4",
]


@pytest.fixture(autouse=True)
def one_cpu_thread():
    # These models are tiny: on a busy 2-core machine, intra-op threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def demo_args(tmp_path, *extra):
    return build_parser().parse_args(["demo", *SMALL, "--plot", str(tmp_path / "p.png"), *extra])


def run_cli(tmp_path, capsys, *extra) -> tuple[int, str]:
    args = demo_args(tmp_path, *extra)
    code = args.func(args)
    return code, capsys.readouterr().out


def table_rows(stdout: str) -> list[dict[str, str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step |"))
    header = [cell.strip() for cell in lines[start].split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if "|" not in line:
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.split("|")), strict=True)))
    return rows


def kib(cell: str) -> float:
    assert cell.endswith(" KiB"), cell
    return float(cell[:-4])


# -- every schedule: bitwise parity ------------------------------------------------------------

SCHEDULE_CASES = [
    (["--schedule", "none"], [0], 1),
    (["--schedule", "1f1b", "--pp", "2", "--rank", "1"], [1], 2),
    (["--schedule", "interleaved"], [1, 3], 4),  # the default: pp 2, vpp 2, last-stage rank 1
    (["--schedule", "interleaved", "--rank", "0"], [0, 2], 4),
    (["--schedule", "interleaved", "--vpp", "3", "--rank", "1"], [1, 3, 5], 6),
    (["--schedule", "dualpipev", "--pp", "2"], [0, 3], 4),
]


@pytest.mark.parametrize(("extra", "stages", "num_stages"), SCHEDULE_CASES,
                         ids=[" ".join(case[0]) for case in SCHEDULE_CASES])
def test_schedule_bitwise_parity_plot_and_memory(tmp_path, capsys, extra, stages, num_stages):
    code, out = run_cli(tmp_path, capsys, *extra)
    assert code == 0, out
    assert out.splitlines()[-1] == "parity: bitwise"
    shown = ", ".join(map(str, stages))
    assert f"holds stage(s) {shown} of {num_stages};" in out
    order = next(line for line in out.splitlines() if line.startswith("order: ")).split()[1:]
    assert sum(op.startswith("F") for op in order) == 4 * len(stages)  # every chunk x microbatch
    png = tmp_path / "p.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = table_rows(out)
    assert [r["action"] for r in rows] == ["calibrate", "ok", "ok"]
    has_loss = num_stages - 1 in stages
    for row in rows:
        assert row["overflow"] == "no" and row["host spills"] == "0"
        assert row["loss control"] == row["loss paged"]
        assert (row["loss paged"] != "-") == has_loss
        assert row["grad norm control"] == row["grad norm paged"]
        assert kib(row["peak held paged"]) < kib(row["peak held control"])
    assert all(int(r["pages used (peak)"]) > 0 for r in rows[1:])


def test_stage_indices():
    assert stage_indices("interleaved", 4, 1, 3) == [1, 5, 9]
    assert stage_indices("dualpipev", 4, 1, 2) == [1, 6]
    assert stage_indices("1f1b", 4, 3, 1) == [3]


def test_reload_destinations_poisoned_with_nan_keep_parity(tmp_path, monkeypatch):
    # Non-live rows of a reloaded buffer are NaN: the model must never let them reach a result.
    real_reload = kernels.reload
    calls = []

    def poisoned(dst, record, pool, backend="auto", max_ctas=None):
        dst.fill_(math.nan)
        calls.append(record)
        real_reload(dst, record, pool, backend, max_ctas)

    monkeypatch.setattr(kernels, "reload", poisoned)
    result = demo_cli.run_demo(demo_args(tmp_path))
    assert calls and result.verdict().line == "parity: bitwise"
    for step in result.paged.steps:
        assert step.pages_left == 0  # every page came back
        assert all(torch.isfinite(g).all() for g in step.grads.values())


def test_corrupted_reload_is_reported_as_mismatch(tmp_path, capsys, monkeypatch):
    real_reload = kernels.reload

    def flip_one_byte(dst, record, pool, backend="auto", max_ctas=None):
        real_reload(dst, record, pool, backend, max_ctas)
        segment = int(torch.nonzero(record.live_rows > 0)[0, 0])  # a live row: it matters
        offset = record.segment_starts[segment] * record.row_bytes + 3  # an fp32 exponent byte
        dst.view(-1).view(torch.uint8)[offset] ^= 0x40

    monkeypatch.setattr(kernels, "reload", flip_one_byte)
    code, out = run_cli(tmp_path, capsys, "--steps", "2")
    assert code == 1
    last = out.splitlines()[-1]
    assert last.startswith("parity: MISMATCH step 2: ") and "gradient(s) differ" in last


# -- calibration, host tier and the overflow policies ------------------------------------------


def test_calibrated_pools_follow_the_pool_factors(tmp_path):
    small = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1", "--pool-factor", "0.5"))
    big = demo_cli.run_demo(
        demo_args(tmp_path, "--steps", "1", "--pool-factor", "1.0", "--host-pool-factor", "0.5")
    )
    small_pools, big_pools = small.paged.calibrated_pools, big.paged.calibrated_pools
    assert [p.row_bytes for p in small_pools] == [p.row_bytes for p in big_pools] == [128, 256]
    for s, b in zip(small_pools, big_pools, strict=True):
        # Same calibration step, so the same peak: pages scale with the factor (whole pages).
        assert b.num_cuda_pages - 1 <= 2 * s.num_cuda_pages <= b.num_cuda_pages + 1
        assert s.num_host_pages == 0
        assert b.num_cuda_pages // 2 - 1 <= b.num_host_pages <= b.num_cuda_pages // 2 + 1


def test_host_tier_absorbs_what_the_device_tier_cannot(tmp_path, capsys):
    code, out = run_cli(tmp_path, capsys, "--pool-factor", "0.3", "--host-pool-factor", "1.0")
    assert code == 0 and out.splitlines()[-1] == "parity: bitwise"
    rows = table_rows(out)
    assert all(r["overflow"] == "no" for r in rows)
    assert all(int(r["host spills"]) > 0 for r in rows[1:])


def test_rerun_policy_keeps_parity_through_overflow(tmp_path, capsys):
    code, out = run_cli(tmp_path, capsys, "--pool-factor", "0.3")
    assert code == 0, out
    assert out.splitlines()[-1] == "parity: bitwise"
    rows = table_rows(out)
    assert [r["action"] for r in rows] == ["calibrate", "rerun", "rerun"]
    assert [r["overflow"] for r in rows] == ["no", "yes", "yes"]
    assert all(r["grad norm paged"] == r["grad norm control"] for r in rows)


def test_skip_policy_leaves_parameters_unchanged(tmp_path, capsys):
    skip = ("--pool-factor", "0.3", "--overflow-policy", "skip")
    code, out = run_cli(tmp_path, capsys, *skip)
    assert code == 0, out
    last = out.splitlines()[-1]
    assert last.startswith("parity: n/a (policy skip skipped 2 step(s); steps before step 2")
    rows = table_rows(out)
    assert [r["action"] for r in rows] == ["calibrate", "skipped", "skipped"]
    assert [r["grad norm paged"] for r in rows[1:]] == ["discarded"] * 2

    # Independently of the demo's own check: after two skipped steps the parameters are the
    # ones the (calibration) step 1 produced, which the control produced too.
    skipped = demo_cli.run_demo(demo_args(tmp_path, *skip))
    one_step = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1"))
    assert skipped.paged.monitor.skipped_steps == 2
    after_one = one_step.control.parameters
    assert skipped.paged.parameters.keys() == after_one.keys()
    for name, value in after_one.items():
        assert torch.equal(skipped.paged.parameters[name], value), name
    assert any(not torch.equal(skipped.control.parameters[n], v) for n, v in after_one.items())


def test_skip_that_updates_parameters_is_reported(tmp_path, capsys, monkeypatch):
    # An optimizer skip that does not skip: the demo must notice and fail.
    def step_anyway(optimizer, skip, closure=None, step_fn=None):
        step_fn(closure)
        return False

    monkeypatch.setattr(overflow, "step_unless", step_anyway)
    code, out = run_cli(tmp_path, capsys, "--pool-factor", "0.3", "--overflow-policy", "skip")
    assert code == 1
    assert "the skipped step changed parameters or state" in out.splitlines()[-1]


def test_grow_policy_next_step_does_not_overflow(tmp_path, capsys):
    code, out = run_cli(tmp_path, capsys, "--pool-factor", "0.3", "--overflow-policy", "grow",
                        "--growth-factor", "4")
    assert code == 0, out
    assert out.splitlines()[-1].startswith("parity: n/a (policy grow skipped 1 step(s);")
    rows = table_rows(out)
    assert [r["action"] for r in rows] == ["calibrate", "grown", "ok"]
    assert [r["overflow"] for r in rows] == ["no", "yes", "no"]
    assert "pools (after grow): " in out

    result = demo_cli.run_demo(demo_args(tmp_path, "--pool-factor", "0.3", "--overflow-policy",
                                         "grow", "--growth-factor", "4"))
    for before, after in zip(result.paged.calibrated_pools, result.paged.pools, strict=True):
        assert after.num_cuda_pages == math.ceil(before.num_cuda_pages * 4)
    assert result.paged.steps[2].pages_left == 0


# -- flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--pool-factor", "0"], "--pool-factor"),
        (["--host-pool-factor", "-1"], "--host-pool-factor"),
        (["--kernel-backend", "triton"], "--kernel-backend"),
        (["--overflow-policy", "drop"], "--overflow-policy"),
        (["--growth-factor", "1"], "--growth-factor"),
        (["--schedule", "gpipe"], "--schedule"),
        (["--rank", "-1"], "--rank"),
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
        (["--schedule", "1f1b", "--vpp", "2"], "--vpp"),
        (["--rank", "2"], "--rank"),
        (["--schedule", "1f1b", "--pp", "3", "--rank", "3"], "--rank"),
        (["--schedule", "interleaved", "--pp", "1"], "--pp"),
        (["--schedule", "interleaved", "--microbatches", "3"], "--microbatches"),
        (["--schedule", "dualpipev", "--microbatches", "3"], "--microbatches"),
        (["--schedule", "none", "--pp", "2"], "--pp"),
        (["--topk", "5"], "--topk"),
        (["--kernel-backend", "cuda"], "--kernel-backend"),
    ],
)
def test_bad_combinations_give_one_line_errors(tmp_path, capsys, extra, flag):
    args = demo_args(tmp_path, *extra)
    assert args.func(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and flag in err and "\n" not in err
    assert captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda(capsys):
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("extra", "last"),
    [
        ([], "parity: bitwise"),
        (["--schedule", "dualpipev"], "parity: bitwise"),
        (["--pool-factor", "0.3"], "parity: bitwise"),
        (["--pool-factor", "0.3", "--overflow-policy", "skip"], "parity: n/a (policy skip"),
        (["--pool-factor", "0.3", "--overflow-policy", "grow", "--growth-factor", "4"],
         "parity: n/a (policy grow"),
    ],
)
def test_cuda_demo(tmp_path, capsys, extra, last):
    args = build_parser().parse_args(
        ["demo", "--device", "cuda", "--steps", "3", "--plot", str(tmp_path / "p.png"), *extra]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "kernel backend: cuda" in out
    assert out.splitlines()[-1].startswith(last)
