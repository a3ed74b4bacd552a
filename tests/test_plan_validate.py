"""Predicted against measured: compare() on hand-made records, then the historical H200 runs of
the one-GPU example (the constant's fit) and of two larger one-GPU sizes (printed)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from plan_validation import compare, format_comparisons  # noqa: E402

from megatron_paging.plan.arms import CONSTANTS, MIB, ArmMemory  # noqa: E402

MEMORY = ArmMemory(
    arm="paged", params=100 * MIB, grads=200 * MIB, optimizer=600 * MIB, embedding_loss=0,
    attention=0, residual=0, dense_mlp=0, router=0, dispatch=0, experts=0, experts_live=0,
    workspace=0, pool_device=50 * MIB, pool_host=0, host_offload=0, constant=0,
    fb_peak=1000 * MIB, optimizer_extra=0, step_peak=1100 * MIB, peak=1100 * MIB,
    peak_phase="optimizer step", peak_moment="", in_flight=1)


def test_compare_by_hand():
    record = {"paged": {"steady_peak_allocated_mib": "1000.0", "steady_fb_peak_allocated_mib":
                        1250, "param_mib": 100, "pool_cuda_mib": "40", "grad_mib": ""}}
    rows = {c.quantity: c for c in compare(record, {"paged": MEMORY})}
    assert set(rows) == {"peak", "fb_peak", "params", "pool_device"}  # empty values skipped
    assert rows["peak"].error_mib == pytest.approx(100.0)
    assert rows["peak"].relative_error == pytest.approx(0.1)
    assert rows["fb_peak"].relative_error == pytest.approx(-0.2)
    assert rows["params"].relative_error == 0.0
    assert rows["pool_device"].relative_error == pytest.approx(0.25)


def test_compare_reads_a_variant_as_its_plan_arm():
    mcore = dataclasses.replace(MEMORY, arm="mcore")
    rows = compare({"mcore.persistent": {"param_mib": 100}}, {"mcore": mcore})
    assert [(c.arm, c.quantity, c.relative_error) for c in rows] == [("mcore.persistent",
                                                                       "params", 0.0)]
    with pytest.raises(ValueError, match="'recompute' is not in the plan"):
        compare({"recompute": {"param_mib": 1}}, {"mcore": mcore})


megatron = pytest.importorskip("megatron.training")


@pytest.fixture(scope="module")
def history():
    from plan_validation import historical

    results = historical()
    print("\n" + format_comparisons(results))
    return results


def test_one_gpu_example_within_a_quarter_percent(history):
    """The example's own model (the constant was fitted on its unpaged arm)."""
    rows = [c for record, cs in history if record.size == "small" for c in cs]
    assert len(rows) == 7 * 6
    assert max(abs(c.relative_error) for c in rows) < 0.0025


def test_state_and_pools_exact_everywhere(history):
    exact = {"params", "grads", "optimizer", "pool_device"}
    rows = [c for _, cs in history for c in cs if c.quantity in exact]
    assert max(abs(c.error_mib) for c in rows) < 0.06


def test_other_sizes_reported(history):
    """Not fitted on: errors are printed; the bound only catches a broken model."""
    for size in ("expert_heavy", "moe_compute"):
        rows = [c for record, cs in history if record.size == size for c in cs
                if c.quantity in ("peak", "fb_peak")]
        worst = max(rows, key=lambda c: abs(c.relative_error))
        print(f"{size}: worst peak error {100 * worst.relative_error:+.2f}% "
              f"({worst.arm} {worst.quantity})")
        assert abs(worst.relative_error) < 0.05


def test_frozen_constant_is_the_fit():
    from plan_validation import fit_workspace

    assert fit_workspace() == pytest.approx(CONSTANTS.workspace_mib, abs=0.05)
