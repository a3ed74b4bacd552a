"""CPU: the whole frontier driver (benchmarks/bench_frontier.py) against a fake example script
that prints Megatron-shaped logs: end-to-end runs, resume, the time budget, --rerun, --env, and
that every runnable arm's flags parse with Megatron's and our parsers."""

from __future__ import annotations

import json

import frontier_bench  # noqa: F401 (a plain import, so sorted first: puts benchmarks/ on sys.path)
import pytest
from frontier.arms import ARMS, IMPLEMENTATION_ENV, SIZES, frontier_extra, script_argv
from frontier.logs import summarize
from frontier_bench import bf, install_fake_example

FAKE = r'''
import os, sys
PAGING = "--moe-paged-stash --moe-paged-stash-page-size 64".split()
argv = BASE + (PAGING if os.environ["PAGED"] == "1" else []) + sys.argv[1:]
if os.environ.get("DRY_RUN") == "1":
    print("\n".join(argv))
    sys.exit(0)
flags, key = {}, None
for tok in argv:
    if tok.startswith("--"):
        key = tok; flags[key] = []
    elif key:
        flags[key].append(tok)
seq, iters = int(flags["--seq-length"][0]), int(flags["--train-iters"][0])
mods = flags.get("--recompute-modules", [])
paged = "--moe-paged-stash" in flags
mcore = os.environ.get("MEGATRON_PAGING_BENCH_IMPLEMENTATION") == "mcore"
act = 3000.0 - (200 if paged else 0) - (1500 if "moe" in mods else 0) - (
    300 if "core_attn" in mods else 0)
act *= seq / 2048
ms = (1200.0 if mcore else 1005.0 if paged else 1000.0) + (300 if "moe" in mods else 0)
ms *= seq / 2048
fb = 8000.0 + act
# The optimizer step's transient (2000) and a pool that lives through it set the step peak where
# the activations are small.
pool = 250.0 if paged else 0.0
steady = max(fb, 8000.0 + 2000.0 + pool)
fraction = os.environ.get("MEGATRON_PAGING_BENCH_MEMORY_FRACTION")
for i in range(1, iters + 1):
    print(f" [t] iteration {i:8d}/{iters:8d} | elapsed time per iteration (ms): "
          f"{ms * (3 if i <= 3 else 1):.1f} | lm loss: 1.0E+01 | grad norm: 3.{i} |", flush=True)
    if fraction and steady > float(fraction) * 143771:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        sys.exit(1)
loss = 10.0 + (1e-6 if mods else 0.0)
with open(os.environ["MEGATRON_PAGING_BENCH_LOSS_LOG"] + ".rank0", "w") as f:
    for i in range(iters * 8):
        f.write(f"{(loss + i / 64).hex()} 2048\n")
print(f"paging-example rank 0: peak_allocated_mib={steady:.1f} "
      f"steady_peak_allocated_mib={steady:.1f} steady_fb_peak_allocated_mib={fb:.1f} "
      f"peak_reserved_mib={steady + 100:.1f} pool_cuda_mib={pool:.1f} pool_host_mib=0.0 "
      "param_mib=1000.0 grad_mib=1000.0 "
      f"optimizer_state_mib=6000.0 paging_mode=x paged_steps={iters if paged else 0} "
      "graph_replays=0 overflow_actions=-")
'''


@pytest.fixture
def fake_example(tmp_path, monkeypatch):
    install_fake_example(tmp_path, FAKE, monkeypatch)
    monkeypatch.setattr(bf, "_total_mib", lambda: 143771.0)
    return tmp_path


def test_driver_end_to_end_resume_and_time_budget(fake_example, capsys):
    out = fake_example / "res" / "frontier.json"
    common = ["--out", str(out), "--sizes", "small", "--arms", "unpaged,paged,recompute",
              "--iters", "5", "--budget-arms", "unpaged,paged", "--budget-size", "small",
              "--budget-gib", "12", "--budget-max-runs", "3",
              "--budget-unit", "512", "--budget-resolution", "512"]
    # Call 1: a time budget too short for anything stops cleanly and says what is left.
    assert bf.main([*common, "--time-budget-s", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["runs"] == {} and data["calls"][0]["stopped"].startswith("time budget")
    assert "small:unpaged" in data["remaining"]
    # Call 2: the frontier only, resumed from call 1's file.
    assert bf.main([*common, "--resume", "--budget", "no"]) == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"small:unpaged", "small:paged", "small:recompute"}
    paged = data["runs"]["small:paged"]
    assert paged["status"] == "ok" and paged["timed_iterations"] == 2
    assert paged["step_ms"]["median"] == pytest.approx(1005.0)
    assert paged["activation_mib"] == pytest.approx(2800.0)
    assert paged["activation_source"] == "steady_fb_peak_allocated_mib"
    # recompute's step peak is the optimizer's (10000); its activations are the fb peak's.
    rec = data["runs"]["small:recompute"]
    assert rec["memory"]["steady_peak_allocated_mib"] == pytest.approx(10000.0)
    assert rec["activation_mib"] == pytest.approx(1500.0)
    assert paged["argv"][-3:] == ["--deterministic-mode", "--train-iters", "5"]
    assert "--moe-paged-stash" in paged["argv"] and paged["env"]["PAGED"] == "1"
    assert data["gpu"] is None or isinstance(data["gpu"], str)
    assert data["commit"] and data["date"] and len(data["calls"]) == 2
    summary = data["summary"]["small"]
    assert summary["paged"]["parity"]["bitwise_equal"] is True
    assert summary["recompute"]["parity"]["bitwise_equal"] is False
    assert summary["paged"]["paged_as_asked"] and summary["unpaged"]["paged_as_asked"]
    # A paged arm whose engine never paged is flagged, not silently a second control.
    runs = dict(data["runs"])
    runs["small:paged"] = {**runs["small:paged"], "memory": {
        **runs["small:paged"]["memory"], "paged_steps": 0.0}}
    assert summarize(runs)["small"]["paged"]["paged_as_asked"] is False
    assert summary["paged"]["steady_fb_peak_allocated_mib"] == pytest.approx(10800.0)
    targets = data["targets"]["small"]
    assert targets["paged_step_le_1.01x_unpaged"]["status"] == "PASS"
    peak = targets["paged_step_peak_le_unpaged_step_peak"]
    assert peak["status"] == "PASS" and peak["informational"]
    assert (peak["paged_step_peak_mib"], peak["unpaged_step_peak_mib"]) == (10800.0, 11000.0)

    assert targets["paged_1.2x_faster_than_recompute_at_le_its_activation"][
        "status"] == "MISS"  # 1.29x faster but 2800 > 1500 MiB
    assert out.with_suffix(".png").exists()
    # Call 3: the budget only; the frontier runs are not repeated.
    capsys.readouterr()
    assert bf.main([*common, "--resume", "--budget", "only"]) == 0
    printed = capsys.readouterr().out
    assert "frontier: start small:" not in printed and "frontier: start budget:" in printed
    assert "frontier: size=small arm=paged seq=" in printed
    data = json.loads(out.read_text())
    outcomes = data["budget"]["outcomes"]
    # Cap 12 GiB = 12288 MiB, state 8000: unpaged fits 1.46 MiB/token -> ~2900 tokens; paged more.
    assert outcomes["unpaged"]["max_seq"] and outcomes["paged"]["max_seq"]
    assert outcomes["paged"]["max_seq"] >= outcomes["unpaged"]["max_seq"]
    assert all(len(o["candidates"]) <= 3 for o in outcomes.values())
    assert "budget" in data["targets"]
    budget_runs = [r for r in data["runs"].values() if r["kind"] == "budget"]
    assert any(r["status"] == "oom" for r in budget_runs)
    assert all(r["env"]["MEGATRON_PAGING_BENCH_MEMORY_FRACTION"] for r in budget_runs)
    assert "targets:" in printed and "left to run" not in printed.split("targets:")[0]
    # Report only: nothing runs, the table comes back from the file. The file may hold a removed
    # arm's run and splits written under the old definition (step peak - state).
    data = json.loads(out.read_text())
    old = dict(data["runs"]["small:recompute"])
    old.update(key="small:paged_recompute_attn_norm", arm="paged_recompute_attn_norm",
               status="error", memory={}, activation_mib=None, step_ms=None)
    data["runs"][old["key"]] = old
    data["runs"]["small:recompute"]["activation_mib"] = 2000.0  # stale: step-based
    data["runs"]["small:recompute"].pop("activation_source")
    out.write_text(json.dumps(data))
    capsys.readouterr()
    assert bf.main(["--out", str(out), "--resume", "--report-only", "--sizes", "small",
                    "--arms", "unpaged,paged,recompute", "--iters", "5", "--budget",
                    "no"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["calls"]) == 3  # report-only adds no call
    assert data["runs"]["small:recompute"]["activation_mib"] == pytest.approx(1500.0)
    assert data["summary"]["small"]["recompute"]["activation_mib"] == pytest.approx(1500.0)
    assert "paged_recompute_attn_norm" not in data["summary"]["small"]
    assert data["removed_arms"]["small:paged_recompute_attn_norm"]["status"] == "error"
    assert "removed arm, not reported: small:paged_recompute_attn_norm (error)" in printed
    assert "fb MiB" in printed and "rsv MiB" in printed and "left to run" not in printed


# ----------------------------------------------------------------------------- Megatron's parser


def test_every_arm_parses_with_megatron_and_our_flags():
    """Megatron's own argparse plus ours accepts every arm's full argument list, and our start-up
    validation accepts every combination (with the arm's benchmark controls)."""
    pytest.importorskip("megatron.training")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_paging.mcore import flags

    parser = flags.add_paging_args(add_megatron_arguments(argparse.ArgumentParser(
        allow_abbrev=False)))
    for size in SIZES:
        for name, arm in ARMS.items():
            argv = script_argv(frontier_extra(size, name), arm.paged)
            args = parser.parse_args(argv)
            flags.paging_config(args, environ={}, cuda_available=False, te_available=False,
                                mcore_manager=arm.env.get(IMPLEMENTATION_ENV) == "mcore")
            assert args.deterministic_mode and args.moe_paged_stash == arm.paged, (size, name)
    # layernorm recompute is refused at start-up without TE, not in the first forward.
    refused = script_argv([*SIZES["expert_heavy"].flags, "--recompute-granularity", "selective",
                           "--recompute-modules", "core_attn", "layernorm"], True)
    with pytest.raises(ValueError, match="--recompute-modules layernorm needs Transformer Eng"):
        flags.paging_config(parser.parse_args(refused), environ={}, cuda_available=False,
                            te_available=False)


def test_rerun_runs_a_done_arm_again_and_refuses_what_the_call_does_not_run(fake_example, capsys):
    out = fake_example / "res" / "frontier.json"
    common = ["--out", str(out), "--sizes", "small", "--arms", "unpaged,paged", "--iters", "5",
              "--budget", "no"]
    assert bf.main(common) == 0
    data = json.loads(out.read_text())
    data["runs"]["small:paged"]["step_ms"]["median"] = -1.0  # marks the old record
    out.write_text(json.dumps(data))
    capsys.readouterr()
    assert bf.main([*common, "--resume"]) == 0  # both done: nothing runs
    assert "frontier: start small:" not in capsys.readouterr().out
    assert bf.main([*common, "--resume", "--rerun", "small:paged"]) == 0
    printed = capsys.readouterr().out
    assert "frontier: start small:paged" in printed
    assert "frontier: start small:unpaged" not in printed
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"small:unpaged", "small:paged"} and len(data["calls"]) == 3
    again = data["runs"]["small:paged"]
    assert again["status"] == "ok" and again["step_ms"]["median"] == pytest.approx(1005.0)
    assert data["runs"]["small:unpaged"]["status"] == "ok"
    assert "--rerun" in data["calls"][-1]["argv"]
    for bad, words in (("small:recompute", "--rerun: small:recompute not among the arms"),
                       ("small-paged", "--rerun: 'small-paged' is not size:arm")):
        with pytest.raises(SystemExit, match=words):
            bf.main([*common, "--resume", "--rerun", bad])
    with pytest.raises(SystemExit, match="--only: 'tiny:paged' is not size:arm"):
        bf.main([*common, "--only", "tiny:paged"])


def test_env_option_reaches_every_run_and_its_record(fake_example, monkeypatch):
    out = fake_example / "res" / "frontier_conn8.json"
    common = ["--out", str(out), "--sizes", "small", "--arms", "unpaged,paged,mcore",
              "--iters", "5", "--budget", "no"]
    # A control in the caller's environment reaches no run: each arm sets its own.
    monkeypatch.setenv(IMPLEMENTATION_ENV, "mcore")
    assert bf.main([*common, "--env", "CUDA_DEVICE_MAX_CONNECTIONS=8"]) == 0
    data = json.loads(out.read_text())
    for key in ("small:unpaged", "small:paged", "small:mcore"):
        run = data["runs"][key]
        assert run["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
        log = (out.parent / f"{run['log']}.log").read_text().splitlines()[0]
        assert log.startswith("# ") and "CUDA_DEVICE_MAX_CONNECTIONS=8 " in log
    assert data["runs"]["small:mcore"]["env"][IMPLEMENTATION_ENV] == "mcore"
    assert IMPLEMENTATION_ENV not in data["runs"]["small:paged"]["env"]
    steps = {arm: row["step_ms"] for arm, row in data["summary"]["small"].items()}
    assert steps == {"unpaged": 1000.0, "paged": 1005.0, "mcore": 1200.0}
    # Resuming needs the environment the file's runs ran under (here: nothing left to run);
    # re-rendering the report runs nothing, so it needs none.
    assert bf.main([*common, "--env", "CUDA_DEVICE_MAX_CONNECTIONS=8", "--resume"]) == 0
    assert bf.main([*common, "--resume", "--report-only"]) == 0
    for bad, words in ((["--env", "CUDA_DEVICE_MAX_CONNECTIONS"], "expected NAME=VALUE"),
                       (["--env", "=8"], "expected NAME=VALUE"),
                       (["--env", "A=1", "--resume"], "ran under .*CUDA_DEVICE_MAX_CONNECTIONS"),
                       (["--resume"], "ran under")):
        with pytest.raises(SystemExit, match=words):
            bf.main([*common, *bad])
