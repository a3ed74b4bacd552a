"""Golden values of emulated ranks (tests/golden_values.py): the comparison on the CPU, and on
the GPU a fresh paged run of every layout against its golden file."""

from __future__ import annotations

import json

import pytest
import torch
from golden_values import (
    GOLDEN_DIR,
    LAYOUTS,
    compare,
    discarded_steps,
    golden_path,
    run,
)

GOLDEN = {"losses": ["0x1.0p+1", "0x1.8p+0"], "grad_checksums": ["0x1.2p-3"],
          "step_peak_mib": {"1": 1000.0, "2": 1200.0}, "fb_peak_mib": {"1": 900.0, "2": 1100.0}}


def _fresh(**changes):
    return {**json.loads(json.dumps(GOLDEN)), **changes}


def test_an_equal_run_matches_and_peaks_may_move_within_one_percent():
    assert compare(GOLDEN, _fresh()) == []
    assert compare(GOLDEN, _fresh(step_peak_mib={"1": 1009.9, "2": 1188.1})) == []


@pytest.mark.parametrize("changes, field", [
    ({"losses": ["0x1.0p+1", "0x1.8000000000001p+0"]}, "losses"),
    ({"losses": ["0x1.0p+1"]}, "losses"),
    ({"grad_checksums": ["0x1.3p-3"]}, "grad_checksums"),
    ({"step_peak_mib": {"1": 1010.1, "2": 1200.0}}, "step_peak_mib iteration 1"),
    ({"fb_peak_mib": {"1": 900.0, "2": 1088.0}}, "fb_peak_mib iteration 2"),
    ({"fb_peak_mib": {"1": 900.0}}, "fb_peak_mib: iterations"),
])
def test_a_difference_is_named(changes, field):
    problems = compare(GOLDEN, _fresh(**changes))
    assert len(problems) == 1 and problems[0].startswith(field)


def test_a_value_difference_shows_both_values_and_their_gap():
    [problem] = compare(GOLDEN, _fresh(grad_checksums=["0x1.2000000000001p-3"]))
    assert "first difference at index 0" in problem
    assert "(0x1.2000000000001p-3, golden 0x1.2p-3: relative gap 2.0e-16)" in problem
    [problem] = compare(GOLDEN, _fresh(losses=["0x1.0p+1"]))
    assert problem.endswith("first difference at index 1")  # one list is shorter: no values


def test_discarded_steps_are_read_from_the_monitors_lines():
    log = "\n".join([
        "megatron-paging: step 3 dropped tokens in MoE dispatch (over the static budget) on 1 "
        "rank(s): raise --moe-expert-rank-capacity-factor",
        "megatron-paging: overflow at rank 8 step 2 layer 1 microbatch 4: the device pool "
        "needed 2,496 rows, holds 2,304; ... (policy rerun: step re-run)",
        "megatron-paging: overflow at rank 8 step 2 layer 3 microbatch 1: ...",
    ])
    assert discarded_steps(log) == {"over_budget": [3], "pool_overflow": [2]}
    assert discarded_steps("") == {"over_budget": [], "pool_overflow": []}


def test_golden_runs_pin_inductor_autotune_off(tmp_path, monkeypatch):
    """A golden run's peak must not depend on Inductor's on-disk autotune cache (its benchmark
    allocates an L2-sized buffer only on a miss): every run sets the example's pin."""
    import golden_values

    seen = {}

    def fake_run(command, env, **kwargs):
        seen.update(env)
        raise RuntimeError("stop after the launch")

    monkeypatch.setattr(golden_values.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stop after the launch"):
        run(LAYOUTS["pp2_ep8_first_stage"], tmp_path)
    assert seen["MEGATRON_PAGING_BENCH_NO_AUTOTUNE"] == "1" and seen["PAGED"] == "1"


def test_the_example_pins_pointwise_autotuning_only_when_asked():
    import sys
    from pathlib import Path

    import torch._inductor.config as inductor_config

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from step_probe import NO_AUTOTUNE_ENV, pin_inductor_autotune

    before = inductor_config.triton.autotune_pointwise
    try:
        assert pin_inductor_autotune({}) is False and inductor_config.triton.autotune_pointwise
        assert pin_inductor_autotune({NO_AUTOTUNE_ENV: "1"}) is True
        assert inductor_config.triton.autotune_pointwise is False
        with pytest.raises(SystemExit, match=f"error: {NO_AUTOTUNE_ENV}='yes': expected 0 or 1"):
            pin_inductor_autotune({NO_AUTOTUNE_ENV: "yes"})
    finally:
        inductor_config.triton.autotune_pointwise = before


def test_every_golden_file_names_its_layout_and_gpu():
    files = sorted(GOLDEN_DIR.glob("*.json"))
    assert files
    for path in files:
        golden = json.loads(path.read_text())
        assert golden["layout"] in LAYOUTS and golden["commit"]
        assert path == golden_path(golden["layout"], golden["gpu"])
        assert golden["grad_checksums"] and golden["step_peak_mib"]


@pytest.mark.gpu
@pytest.mark.training_run
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_emulated_rank_matches_its_golden_values(tmp_path, name):
    path = golden_path(name, torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no golden values for this GPU ({path.name}): "
                    f"python tests/golden_values.py update {name}")
    fresh = run(LAYOUTS[name], tmp_path)
    assert compare(json.loads(path.read_text()), fresh) == []
