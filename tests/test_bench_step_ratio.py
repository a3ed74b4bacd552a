"""CPU: benchmarks/bench_step_ratio.py against a fake example whose step time drifts from run to
run (as a GPU's does between and within calls): the round-robin order, the per-round ratios that
cancel the drift, the verdicts, parity, the arms' benchmark controls, the time budget and the
argument errors."""

from __future__ import annotations

import json

import frontier_bench  # noqa: F401 (puts benchmarks/ on sys.path)
import pytest
from frontier_bench import install_fake_example, load_script

sr = load_script("bench_step_ratio")

# Every run is 3% slower than the run before it (a counter file), paged costs 0.5% and the
# manager 5%; paged's losses equal the control's, the manager's do not.
FAKE = r'''
import os, sys
from pathlib import Path
if os.environ.get("DRY_RUN") == "1":  # the frontier asks the script for its whole argv
    paging = ["--moe-paged-stash"] if os.environ["PAGED"] == "1" else []
    print("\n".join(BASE + paging + sys.argv[1:]))
    sys.exit(0)
counter = Path(os.environ["FAKE_COUNTER"])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
argv = sys.argv[1:]
iters = int(argv[argv.index("--train-iters") + 1])
mcore = os.environ.get("MEGATRON_PAGING_BENCH_IMPLEMENTATION") == "mcore"
paged = os.environ["PAGED"] == "1"
ms = 1000.0 * (1.03 ** n) * (1.05 if mcore else 1.005 if paged else 1.0)
for i in range(1, iters + 1):
    print(f" [t] iteration {i:8d}/{iters:8d} | elapsed time per iteration (ms): "
          f"{ms * (3 if i <= 3 else 1):.1f} | lm loss: 1.0E+01 | grad norm: 3.0 |", flush=True)
loss = 10.0 + (1e-6 if mcore else 0.0)
with open(os.environ["MEGATRON_PAGING_BENCH_LOSS_LOG"] + ".rank0", "w") as f:
    for i in range(iters * 8):
        f.write(f"{(loss + i / 64).hex()} 2048\n")
print("paging-example rank 0: peak_allocated_mib=9000.0 steady_peak_allocated_mib=9000.0 "
      "steady_fb_peak_allocated_mib=9000.0 peak_reserved_mib=9100.0 pool_cuda_mib=0.0 "
      "pool_host_mib=0.0 param_mib=1000.0 grad_mib=1000.0 optimizer_state_mib=6000.0 "
      f"paging_mode=x paged_steps={iters if paged else 0} graph_replays=0 overflow_actions=-")
'''


@pytest.fixture
def fake_example(tmp_path, monkeypatch):
    install_fake_example(tmp_path, FAKE, monkeypatch)
    monkeypatch.setenv("FAKE_COUNTER", str(tmp_path / "counter"))
    return tmp_path


def test_rounds_cancel_the_drift_that_one_pass_would_report(fake_example, capsys):
    out = fake_example / "res" / "step_ratio.json"
    argv = ["--size", "small", "--arms", "paged,mcore", "--rounds", "2", "--iters", "5",
            "--out", str(out), "--env", "CUDA_DEVICE_MAX_CONNECTIONS=32"]
    assert sr.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["order"] for r in data["rounds"]] == [
        ["unpaged", "paged", "mcore"], ["mcore", "paged", "unpaged"]]
    assert all(r["complete"] for r in data["rounds"]) and data["commit"] and data["date"]
    paged = data["summary"]["paged"]
    # One pass in a fixed order would read paged at 1.005 x 1.03; the two rounds read it once
    # after the control, once before: 1.005 x 1.03 and 1.005 / 1.03 (median 1.005 x 1.0004).
    assert paged["ratios"] == pytest.approx([1.005 * 1.03, 1.005 / 1.03], rel=1e-3)
    assert paged["median"] == pytest.approx(1.005 * (1.03 + 1 / 1.03) / 2, rel=1e-3)
    assert paged["verdict"] == "UNRESOLVED"  # 1.035 above 1.01, 0.976 below: one call can't say
    assert paged["bitwise_equal_every_round"] and paged["parity_required"]
    manager = data["summary"]["mcore"]
    assert manager["ratios"] == pytest.approx([1.05 * 1.03**2, 1.05 / 1.03**2], rel=1e-3)
    assert manager["bitwise_equal_every_round"] is False
    runs = data["rounds"][0]["runs"]
    assert runs["paged"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert runs["mcore"]["env"]["MEGATRON_PAGING_BENCH_IMPLEMENTATION"] == "mcore"
    assert "MEGATRON_PAGING_BENCH_IMPLEMENTATION" not in runs["paged"]["env"]
    assert "--moe-paged-stash" in runs["paged"]["argv"]
    printed = capsys.readouterr().out
    assert "step_ratio: round 1 arm=unpaged status=ok" in printed and "[6/6]" in printed
    assert any(line.startswith("paged ") and "UNRESOLVED" in line for line in printed.splitlines())


def test_verdicts_from_ratios():
    def rounds(*pairs):
        return [{"complete": True, "runs": {"unpaged": {"step_ms": {"median": c}},
                                            "paged": {"step_ms": {"median": p}}}}
                for c, p in pairs] + [{"complete": False, "runs": {}}]

    summary = sr.summarize_rounds(rounds((1000, 1005), (1010, 1012)), ["paged"], 1.01)
    assert summary["paged"]["verdict"] == "PASS" and len(summary["paged"]["ratios"]) == 2
    summary = sr.summarize_rounds(rounds((1000, 1030), (1010, 1030)), ["paged"], 1.01)
    assert summary["paged"]["verdict"] == "MISS"
    assert summary["paged"]["bitwise_equal_every_round"] is False  # no losses: not shown equal
    assert sr.summarize_rounds(rounds(), ["paged"], 1.01)["paged"]["verdict"] == "NOT RUN"


def test_a_time_budget_leaves_the_cut_round_out(fake_example, capsys):
    out = fake_example / "cut.json"
    argv = ["--size", "small", "--arms", "paged", "--rounds", "3", "--iters", "5",
            "--out", str(out), "--time-budget-s", "1"]
    assert sr.main(argv) == 1  # not every round completed
    data = json.loads(out.read_text())
    assert data["stopped"].startswith("time budget: round 0 unpaged")
    assert data["summary"]["paged"]["verdict"] == "NOT RUN"


@pytest.mark.parametrize("argv, words", [
    (["--arms", "warp_drive"], "not frontier arms"),
    (["--arms", "unpaged"], "is the control every round runs anyway"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--iters", "3"], "--iters must be > 3"),
    (["--env", "NOVALUE"], "expected NAME=VALUE"),
])
def test_argument_errors_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as error:
        sr.main(argv)
    message = capsys.readouterr().err + str(error.value.code)
    assert words in message
