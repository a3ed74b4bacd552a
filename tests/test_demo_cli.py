"""The demo CLI: one pipeline rank of TinyMoE through the paging runtime, step by step;
bitwise parity on every schedule, calibration, the host tier, the overflow policies and the
verdict (flags, printed output and --plot: test_demo_cli_flags.py)."""

from __future__ import annotations

import math

import pytest
import torch
from demo_helpers import (
    CPU_FACTOR,
    CUDA_FACTOR,
    PNG,
    POLICY,
    actions,
    assert_same_grads,
    demo_args,
    run_cli,
)

from megatron_paging import kernels
from megatron_paging.demo import cli as demo_cli
from megatron_paging.demo import training
from megatron_paging.demo.layout import stage_indices
from megatron_paging.demo.training import StepOutcome
from megatron_paging.demo.verdict import compare
from megatron_paging.kernels import KernelBackend
from megatron_paging.overflow import optimizer_skip
from megatron_paging.overflow.demand import GROW_HEADROOM

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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
def test_schedule_bitwise_parity_plot_and_memory(
    tmp_path, capsys, monkeypatch, extra, stages, num_stages
):
    run = run_cli(tmp_path, capsys, monkeypatch, *extra)
    assert run.code == 0, run.out
    assert run.last == "parity: bitwise"
    layout, result = run.result.layout, run.result
    assert (layout.stages, layout.num_stages) == (stages, num_stages)
    assert sum(op.kind == "F" for op in layout.ops) == 4 * len(stages)  # chunks x microbatches
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
    assert actions(result) == ["calibrate", "ok", "ok"]
    has_loss = num_stages - 1 in stages
    for c, p in zip(result.control.steps, result.paged.steps, strict=True):
        assert not p.overflow and p.host_spills == 0
        assert (p.loss is not None) == has_loss
        assert has_loss == (c.loss is not None) and (not has_loss or torch.equal(c.loss, p.loss))
        assert_same_grads(c, p)
        assert p.peak_bytes < c.peak_bytes
    assert all(p.peak_pages > 0 for p in result.paged.steps[1:])


@pytest.mark.parametrize("extra", [["--paging-hold-last-slot"], ["--paging-prefetch-distance",
                                                                  "0"]])
def test_scheduler_flags_keep_bitwise_parity(tmp_path, extra):
    result = demo_cli.run_demo(demo_args(tmp_path, "--schedule", "dualpipev", *extra))
    assert result.verdict().line == "parity: bitwise"
    assert actions(result) == ["calibrate", "ok", "ok"]


def test_stage_indices():
    assert stage_indices("interleaved", 4, 1, 3) == [1, 5, 9]
    assert stage_indices("dualpipev", 4, 1, 2) == [1, 6]
    assert stage_indices("1f1b", 4, 3, 1) == [3]


def wrap_reference_kernel(monkeypatch, on_reload):
    """Replace the registry's ``reference`` backend (the scheduler resolves it once per step)
    by one whose reloads go through ``on_reload(real_copy, dst, record, pool, max_ctas)``."""
    real = kernels.REGISTRY["reference"]

    def copy(reload, tensor, record, pool, max_ctas):
        if not reload:
            return real.copy(reload, tensor, record, pool, max_ctas)
        return on_reload(real.copy, tensor, record, pool, max_ctas)

    wrapped = KernelBackend(real.name, copy, real.device_types, real.prepare_pool)
    monkeypatch.setitem(kernels.REGISTRY, "reference", wrapped)


def test_reload_destinations_poisoned_with_nan_keep_parity(tmp_path, monkeypatch):
    # Non-live rows of a reloaded buffer are NaN: the model must never let them reach a result.
    calls = []

    def poisoned(real_copy, dst, record, pool, max_ctas):
        dst.fill_(math.nan)
        calls.append(record)
        real_copy(True, dst, record, pool, max_ctas)

    wrap_reference_kernel(monkeypatch, poisoned)
    result = demo_cli.run_demo(demo_args(tmp_path))
    assert calls and result.verdict().line == "parity: bitwise"
    for step in result.paged.steps:
        assert step.pages_left == 0  # every page came back
        assert all(torch.isfinite(g).all() for g in step.grads.values())


def test_corrupted_reload_is_reported_as_mismatch(tmp_path, capsys, monkeypatch):
    def flip_one_byte(real_copy, dst, record, pool, max_ctas):
        real_copy(True, dst, record, pool, max_ctas)
        segment = int(torch.nonzero(record.live_rows > 0)[0, 0])  # a live row: it matters
        offset = record.segment_starts[segment] * record.row_bytes + 3  # an fp32 exponent byte
        dst.view(-1).view(torch.uint8)[offset] ^= 0x40

    wrap_reference_kernel(monkeypatch, flip_one_byte)
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "2")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    (c1, c2), (p1, p2) = run.result.control.steps, run.result.paged.steps
    assert compare(1, c1, p1) == []  # calibration reloads nothing
    assert any(not torch.equal(c2.grads[k], p2.grads[k]) for k in c2.grads)


# -- calibration, host tier and the overflow policies ------------------------------------------


def test_calibrated_pools_follow_the_pool_factors(tmp_path):
    small = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1", CUDA_FACTOR, "0.5"))
    big = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1", CUDA_FACTOR, "1.0", CPU_FACTOR,
                                      "0.5"))
    small_pools, big_pools = small.paged.calibrated_pools, big.paged.calibrated_pools
    assert [p.row_bytes for p in small_pools] == [p.row_bytes for p in big_pools] == [128, 256]
    for s, b in zip(small_pools, big_pools, strict=True):
        # Same calibration step, so the same peak: pages scale with the factor (whole pages).
        assert b.num_cuda_pages - 1 <= 2 * s.num_cuda_pages <= b.num_cuda_pages + 1
        assert s.num_host_pages == 0
        assert b.num_cuda_pages // 2 - 1 <= b.num_host_pages <= b.num_cuda_pages // 2 + 1


def test_host_tier_absorbs_what_the_device_tier_cannot(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", CPU_FACTOR, "1.0")
    assert run.code == 0 and run.last == "parity: bitwise"
    steps = run.result.paged.steps
    assert not any(step.overflow for step in steps)
    assert all(step.host_spills > 0 for step in steps[1:])


def test_rerun_policy_keeps_parity_through_overflow(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3")
    assert run.code == 0, run.out
    assert run.last == "parity: bitwise"
    # Step 2 overflows and runs again in pools grown to what it needed (counted on the
    # device): no unpaged pass, and step 3 fits the grown pools.
    assert actions(run.result) == ["calibrate", "rerun", "ok"]
    assert [step.overflow for step in run.result.paged.steps] == [False, True, False]
    monitor = run.result.paged.monitor
    assert monitor.rerun_steps == 1 and monitor.unpaged_reruns == 0
    calibrated, grown = run.result.paged.calibrated_pools, run.result.paged.pools
    assert all(grown[p.row_bytes].num_cuda_pages > p.num_cuda_pages for p in calibrated)


def test_skip_policy_leaves_parameters_unchanged(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", POLICY, "skip")
    assert run.code == 0, run.out
    assert run.last.startswith("parity: n/a (policy skip skipped 2 step(s);")
    skipped = run.result
    assert actions(skipped) == ["calibrate", "skipped", "skipped"]
    assert skipped.paged.monitor.skipped_steps == 2

    # Independently of the demo's own check: after two skipped steps the parameters are the
    # ones the (calibration) step 1 produced, which the control produced too.
    one_step = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1"))
    after_one = one_step.control.parameters
    assert skipped.paged.parameters.keys() == after_one.keys()
    for name, value in after_one.items():
        assert torch.equal(skipped.paged.parameters[name], value), name
    assert any(not torch.equal(skipped.control.parameters[n], v) for n, v in after_one.items())


def test_skip_that_updates_parameters_is_reported(tmp_path, capsys, monkeypatch):
    # An optimizer skip that does not skip: the demo must notice and fail.
    def never_wrap(self, optimizer, get_skip):
        self.host_reads = 0

    monkeypatch.setattr(optimizer_skip.DeviceSkip, "__init__", never_wrap)
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", POLICY, "skip")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    assert [step.state_unchanged for step in run.result.paged.steps] == [None, False, False]


def test_grow_policy_next_step_does_not_overflow(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.7", POLICY, "grow")
    assert run.code == 0, run.out
    assert run.last.startswith("parity: n/a (policy grow skipped 1 step(s);")
    result = run.result
    assert actions(result) == ["calibrate", "grown", "ok"]
    assert [step.overflow for step in result.paged.steps] == [False, True, False]
    (record,) = result.paged.monitor.overflow_records
    for before, after in zip(result.paged.calibrated_pools, result.paged.pools, strict=True):
        # 'grow' sizes a pool that fell short from what the overflowing step needed (its
        # device-side peak, left in the replaced pool), plus GROW_HEADROOM; one that fitted
        # stays; the demo's routing repeats, so the next step fits (below)
        needed_pages = int(before.peak_pages)
        if before.row_bytes == record["row_bytes"]:
            assert needed_pages * before.page_size == record["rows_needed"]
            assert after.num_cuda_pages * after.page_size == record["grown_rows"]
        if needed_pages > before.num_cuda_pages:
            assert after.num_cuda_pages == math.ceil(needed_pages * GROW_HEADROOM)
        else:
            assert after.num_cuda_pages == before.num_cuda_pages
    assert result.paged.steps[2].pages_left == 0


# -- the verdict compares what the rank sends upstream -----------------------------------------


def outcome(grad=1.0, sent=1.0):
    return StepOutcome(action="ok", loss=torch.tensor(2.0), grads={"w": torch.tensor([grad])},
                       sent_grads={(0, 1): torch.tensor([sent])}, peak_bytes=0)


def test_compare_reports_parameter_and_sent_input_gradients_apart():
    assert compare(1, outcome(), outcome()) == []
    wrong_grad, wrong_sent = compare(1, outcome(), outcome(grad=3.0)), compare(2, outcome(),
                                                                              outcome(sent=3.0))
    assert len(wrong_grad) == len(wrong_sent) == 1 and wrong_grad != wrong_sent
    assert "(0, 1)" in wrong_sent[0] and "(0, 1)" not in wrong_grad[0]


def test_a_wrong_gradient_sent_upstream_is_a_mismatch(tmp_path, capsys, monkeypatch):
    """Loss and parameter gradients stay bitwise; only the input gradient a chunk sends to the
    previous stage differs (as a wrong reload of a first layer's input would make it)."""
    real_run_step = training.run_step

    def run_step(chunks, ops, context, ends, **kwargs):
        left = real_run_step(chunks, ops, context, ends, **kwargs)
        if context.engine is not None and context.engine.steps == 2:  # the paged run, step 2
            key = min(ends.sent_grads)
            ends.sent_grads[key] = ends.sent_grads[key] * 2
        return left

    monkeypatch.setattr(training, "run_step", run_step)
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "2")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    for c, p in zip(run.result.control.steps, run.result.paged.steps, strict=True):
        assert torch.equal(c.loss, p.loss)
        assert_same_grads(c, p)
    c, p = run.result.control.steps[1], run.result.paged.steps[1]
    assert [k for k in c.sent_grads if not torch.equal(c.sent_grads[k], p.sent_grads[k])] == [
        min(c.sent_grads)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("extra", "last"),
    [
        ([], "parity: bitwise"),
        (["--schedule", "dualpipev"], "parity: bitwise"),
        ([CUDA_FACTOR, "0.3"], "parity: bitwise"),
        ([CUDA_FACTOR, "0.3", POLICY, "skip"], "parity: n/a (policy skip"),
        ([CUDA_FACTOR, "0.7", POLICY, "grow"], "parity: n/a (policy grow"),
    ],
)
def test_cuda_demo(tmp_path, capsys, monkeypatch, extra, last):
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "3", *extra, base=["--device", "cuda"])
    assert run.code == 0, run.out
    assert run.result.backend == "cuda"
    assert run.last.startswith(last)
