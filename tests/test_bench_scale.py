"""bench_scale.py on the CPU: which runs it plans (round robin, resumable) and how it reads the
example's output (no GPU: the example is faked). Its summary: test_scale_summary.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_scale  # noqa: E402
from scale_layouts import LAYOUTS, RERUN_PAIRS  # noqa: E402

ITER = " [2026-12-04] iteration {}/ 5 | consumed samples: 1 | elapsed time per iteration (ms): {} |"
LOG = "\n".join([
    ITER.format(3, 2100.5),
    "paging-example step-memory iteration=3 peak_allocated_mib=51234.5 host_fb_ms=1.0",
    ITER.format(4, 2080.0),
    ITER.format(5, 2090.0),
    "paging-example rank 0: peak_allocated_mib=52000.0 steady_peak_allocated_mib=51234.5 "
    "steady_fb_peak_allocated_mib=50000.0 pool_cuda_mib=9000.0 peers=emulated:lognormal:0.3",
])


def test_runs_alternate_arms_and_the_parity_and_rerun_pairs_run_where_unpaged_fits():
    runs = [(layout.name, rank, arm, cf) for layout, rank, arm, cf in
            bench_scale.plan_runs(["qwen3_235b"], list(bench_scale.ARMS), [2.0, 1.5], False)]
    first, second = LAYOUTS["qwen3_235b"].ranks
    assert runs[:3] == [("qwen3_235b", first, "unpaged", 2.0),
                        ("qwen3_235b", second, "unpaged", 2.0),
                        ("qwen3_235b", first, "paged", 2.0)]
    pairs = {*bench_scale.PARITY_PAIR, *RERUN_PAIRS[0]}  # the MLA pair: DeepSeek-V3
    assert {arm for _, rank, arm, _ in runs if rank == second} == {"unpaged", "paged", *pairs}
    assert not {arm for _, rank, arm, _ in runs if rank == first} & pairs
    assert [arm for _, _, arm, cf in runs if cf == 1.5] == ["unpaged", "paged"]
    # an arm for MLA layouts only: Megatron refuses mla_up_proj without MLA
    mla_only = "paged.recompute_mla_up_proj"
    assert mla_only not in {arm for _, _, arm, _ in runs}
    deepseek = [(rank, arm) for _, rank, arm, _ in bench_scale.plan_runs(
        ["deepseek_v3"], list(bench_scale.ARMS), [2.0], False)]
    assert mla_only in {arm for _, arm in deepseek}
    # both rerun pairs on the last stage only (the paged pair's rerun may not fit beside it)
    last = LAYOUTS["deepseek_v3"].ranks[-1]
    assert {(rank, arm) for rank, arm in deepseek if "hot_step" in arm} == {
        (last, arm) for arm in bench_scale.RERUN_ARMS}


def test_an_arm_is_read_from_the_examples_output(tmp_path, monkeypatch):
    layout = LAYOUTS["deepseek_v3"]

    def fake_run(cmd, **kwargs):
        log_path = Path(kwargs["env"]["MEGATRON_PAGING_BENCH_LOSS_LOG"])
        Path(f"{log_path}.rank256").write_text("0x1.0p+0 4096\ngrad 0x1.8p-3\n")
        assert kwargs["env"]["WORLD_SIZE"] == "2048" and kwargs["env"]["RANK"] == "256"
        assert "--fake-process-group" in cmd and "--moe-paged-stash" in cmd
        assert cmd[cmd.index(bench_scale.POOL_FLAG) + 1] == "1.234"  # the plan's factor
        return subprocess.CompletedProcess(cmd, 0, LOG, "")

    monkeypatch.setattr(bench_scale.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_scale, "planned_pool_factor", lambda argv, lay, rank: 1.234)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    record = bench_scale.run_arm(layout, 256, "paged", 2.0, tmp_path, timeout=10)
    assert record["status"] == "ok" and record["stage"] == 2
    assert record["alloc_conf"] == "expandable_segments:True"  # inherited, so recorded
    assert record["pool_factor"] == 1.234
    assert record["pool_factor_rate"] == bench_scale.POOL_OVERFLOW_RATE
    assert record["median_steady_iteration_ms"] == 2090.0
    assert record["losses"] == ["0x1.0p+0"] and record["grad_checksums"] == ["0x1.8p-3"]
    assert record["report"]["steady_peak_allocated_mib"] == "51234.5"
    assert record["step_peaks_mib"] == {3: 51234.5}
    assert "peak_owners" not in record


def test_the_peaks_owners_are_kept_when_the_example_names_them(tmp_path, monkeypatch):
    """MEGATRON_PAGING_BENCH_MEMORY_ITER makes the example print what holds the peak."""
    owners = ["paging-example memory-fb allocated peak above trace start: 9000.0 MiB",
              "paging-example memory-fb     4000.0 MiB     75 blocks  attention.py:260 forward"]
    log = "\n".join([LOG, *owners])
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 0, log, "")))
    record = bench_scale.run_arm(LAYOUTS["qwen3_235b"], 224, "unpaged", 2.0, tmp_path, 10)
    assert record["status"] == "ok" and record["peak_owners"] == owners


def test_out_of_memory_is_recorded_not_raised(tmp_path, monkeypatch):
    progress = ["step-memory iteration=1 peak_allocated_mib=86654.1",
                "paging: overflow at rank 0 step 2 layer 1 microbatch 4"]
    # the traceback after the progress lines pushes them out of the log's tail
    log = "\n".join([*progress, *["  File \"x.py\", line 1, in f"] * 400,
                     "torch.OutOfMemoryError: CUDA out of memory"])
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 1, "", log)))
    record = bench_scale.run_arm(LAYOUTS["qwen3_235b"], 0, "unpaged", 2.0, tmp_path, 10)
    assert record["status"] == "out of memory" and "log_tail" in record
    assert progress[0] not in record["log_tail"]
    assert record["progress"] == [*progress, "torch.OutOfMemoryError: CUDA out of memory"]


def test_every_layout_flag_is_a_megatron_flag():
    pytest.importorskip("megatron.training")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_paging.mcore.flags import add_paging_args

    parser = add_paging_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    for layout in LAYOUTS.values():
        for arm in bench_scale.ARMS.values():
            args = parser.parse_args([*layout.flags(0), *arm.flags])
            assert args.fake_process_group and args.use_distributed_optimizer
        assert json.dumps(layout.env(layout.ranks[0]))


def test_offload_arms_run_with_one_hardware_queue_unless_the_arm_names_more(tmp_path,
                                                                           monkeypatch):
    queues = []

    def fake_run(cmd, **kwargs):
        if "env" in kwargs:  # the example's launch, not a helper's query
            queues.append(kwargs["env"]["CUDA_DEVICE_MAX_CONNECTIONS"])
        return subprocess.CompletedProcess(cmd, 0, LOG, "")

    monkeypatch.setattr(bench_scale.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the caller's: never an arm's
    layout = LAYOUTS["qwen3_235b"]
    for arm in ("offload", "offload.connections_32", "paged_offload_experts.connections_32"):
        bench_scale.run_arm(layout, layout.ranks[0], arm, 2.0, tmp_path, timeout=10)
    assert queues == ["1", "32", "32"]


def test_a_failed_arm_fails_the_call(tmp_path, monkeypatch):
    """Out of memory is a result; an arm that failed is not, and the call says so."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 1, "", "error: something else")))
    out = tmp_path / "scale.json"
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 1
    assert [r["status"] for r in json.loads(out.read_text())["runs"]] == ["failed", "failed"]
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory")))
    out.unlink()
    assert bench_scale.main(argv) == 0


def test_resumed_runs_keep_their_commit_and_out_of_memory_arms_can_be_retried(tmp_path,
                                                                             monkeypatch):
    """A resumed file spans several calls: each run records the commit and date it measured (old
    runs take the file's). ``--retry-out-of-memory`` runs such arms again and replaces their
    records; without it they are results and stay."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "new"})
    old = {"layout": "qwen3_235b", "rank": 0, "stage": 0, "arm": "unpaged",
           "capacity_factor": 2.0, "status": "out of memory"}
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"benchmark": "scale", "commit": "old", "date": "then",
                               "arm_naming": "plan_arm[.variant]", "runs": [old]}))
    calls = []
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        calls.append(cmd), subprocess.CompletedProcess(
            cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory"))[1])
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 0 and len(calls) == 1  # only the second rank ran
    runs = json.loads(out.read_text())["runs"]
    assert [(r["rank"], r["commit"], r["date"]) for r in runs] == [(0, "old", "then"),
                                                                  (224, "new", "today")]
    # A retry of other arms keeps this arm's out-of-memory record as it is.
    other = ["--layouts", "qwen3_235b", "--arms", "recompute", "--capacity-factors", "2.0",
             "--out", str(out), "--retry-out-of-memory"]
    assert bench_scale.main(other) == 0 and len(calls) == 2
    runs = json.loads(out.read_text())["runs"]
    assert [(r["arm"], r["rank"], r["commit"]) for r in runs] == [
        ("unpaged", 0, "old"), ("unpaged", 224, "new"), ("recompute", 0, "new")]
    assert bench_scale.main([*argv, "--retry-out-of-memory"]) == 0 and len(calls) == 4
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["rank"], r["commit"]) for r in runs if r["arm"] == "unpaged") == [
        (0, "new"), (224, "new")]


def test_rerun_recorded_replaces_each_record_only_when_its_new_run_ends(tmp_path, monkeypatch):
    """``--rerun-recorded`` (after a change to the measured code): recorded arms run again; an arm
    the time budget leaves for a later call keeps its old record."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "new"})
    clock = [0.0]
    monkeypatch.setattr(bench_scale.time, "perf_counter", lambda: clock[0])

    def run(cmd, **kw):
        clock[0] += 100.0
        return subprocess.CompletedProcess(cmd, 0, LOG, "")

    monkeypatch.setattr(bench_scale.subprocess, "run", run)
    layout = LAYOUTS["qwen3_235b"]
    old = [{"layout": "qwen3_235b", "rank": rank, "stage": layout.stage(rank), "arm": "unpaged",
            "capacity_factor": 2.0, "status": "out of memory", "commit": "old",
            "flags": bench_scale.arm_argv(layout, rank, "unpaged", 2.0)[0]}
           for rank in layout.ranks]
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"benchmark": "scale", "commit": "old", "date": "then",
                               "arm_naming": "plan_arm[.variant]", "runs": old}))
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 0 and clock[0] == 0.0  # recorded: nothing runs
    assert bench_scale.main([*argv, "--rerun-recorded", "--time-budget", "50"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["rank"], r["commit"]) for r in runs) == [(0, "new"), (224, "old")]
    assert bench_scale.main([*argv, "--rerun-recorded"]) == 0
    assert [r["commit"] for r in json.loads(out.read_text())["runs"]] == ["new", "new"]


def test_the_file_records_the_gpus_memory(monkeypatch):
    """What "fits" means for every arm of a scale file: the GPU's total memory (faked here)."""
    class Props:
        total_memory = 150 * 2**30

    monkeypatch.setattr(bench_scale.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_scale.torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(bench_scale, "header", lambda name, **extra: {"benchmark": name, **extra})
    assert bench_scale.scale_header()["device_memory_mib"] == 150 * 1024
    monkeypatch.setattr(bench_scale.torch.cuda, "is_available", lambda: False)
    assert "device_memory_mib" not in bench_scale.scale_header()


def test_a_record_launched_with_other_flags_runs_again(tmp_path, monkeypatch):
    """A resumed file's record whose launch line differs from the arm's current one (a changed
    layout, arm or pool factor) is not a result of this benchmark any more: it runs again."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "new"})
    layout = LAYOUTS["qwen3_235b"]
    current = bench_scale.arm_argv(layout, 0, "unpaged", 2.0)[0]
    assert "--moe-router-force-load-balancing" in current
    kept = {"layout": "qwen3_235b", "rank": 0, "stage": 0, "arm": "unpaged",
            "capacity_factor": 2.0, "status": "out of memory", "flags": current}
    stale = {"layout": "qwen3_235b", "rank": 224, "stage": 7, "arm": "unpaged",
             "capacity_factor": 2.0, "status": "ok", "flags": current[:-1]}
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"benchmark": "scale", "commit": "old", "date": "then",
                               "arm_naming": "plan_arm[.variant]", "runs": [kept, stale]}))
    calls = []
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        calls.append(kw["env"]["RANK"]), subprocess.CompletedProcess(
            cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory"))[1])
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 0 and calls == ["224"]
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["rank"], r["commit"], r["status"]) for r in runs) == [
        (0, "old", "out of memory"), (224, "new", "out of memory")]


def test_an_arm_the_plan_puts_well_above_the_gpu_is_recorded_as_predicted_not_run(
        tmp_path, monkeypatch):
    """``--skip-predicted-oom 0.1``: an arm planned at more than 1.1x the GPU's memory is
    recorded as predicted out of memory, with the plan's peak, and not launched; a later call
    without the option runs it and replaces the record."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "c",
        "device_memory_mib": 1000.0})
    monkeypatch.setattr(bench_scale, "predicted_peak_mib",
                        lambda layout, rank, arm, factor: 1200.0 if rank == 0 else 1050.0)
    calls = []
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        calls.append(cmd), subprocess.CompletedProcess(cmd, 0, LOG, ""))[1])
    out = tmp_path / "scale.json"
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main([*argv, "--skip-predicted-oom", "0.1"]) == 0
    runs = {r["rank"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs[0]["status"] == bench_scale.PREDICTED_OOM and runs[0]["predicted_peak_mib"] == 1200
    assert runs[224]["status"] == "ok" and len(calls) == 1  # within the margin: it ran
    assert runs[224]["predicted_peak_mib"] == 1050  # a run keeps its own commit's plan beside it
    assert bench_scale.main(argv) == 0 and len(calls) == 2
    assert {r["rank"]: r["status"] for r in json.loads(out.read_text())["runs"]} == {
        0: "ok", 224: "ok"}


def test_a_call_for_other_arms_keeps_every_record_it_does_not_plan(tmp_path, monkeypatch):
    """Resuming a file for a few arms leaves the others' records as they are, predicted out of
    memory included (a call for three arms once dropped every other predicted record)."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "new"})
    kept = [{"layout": "qwen3_235b", "rank": rank, "stage": 0, "arm": "unpaged",
             "capacity_factor": 2.0, "status": status}
            for rank, status in ((0, bench_scale.PREDICTED_OOM), (224, "failed"))]
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"benchmark": "scale", "commit": "old", "date": "then",
                               "arm_naming": "plan_arm[.variant]", "runs": kept}))
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        subprocess.CompletedProcess(cmd, 0, LOG, "")))
    argv = ["--layouts", "qwen3_235b", "--arms", "recompute", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["arm"], r["rank"], r["status"]) for r in runs) == [
        ("recompute", 0, "ok"), ("unpaged", 0, bench_scale.PREDICTED_OOM),
        ("unpaged", 224, "failed")]


def test_the_predicted_peak_is_the_plans_for_the_arm_the_line_launches():
    """The plan run on the arm's own launch line (CPU, seconds): Qwen3-235B's stage 0 unpaged at
    capacity factor 2 is planned above an H200's 143,156 MiB, its paged arm below."""
    from plan_predictions import predict

    layout = LAYOUTS["qwen3_235b"]
    unpaged = bench_scale.predicted_peak_mib(layout, 0, "unpaged", 2.0)
    paged = bench_scale.predicted_peak_mib(layout, 0, "paged", 2.0)
    assert unpaged == predict(layout, 0, "unpaged", 2.0)["predicted"]["peak_mib"]
    assert paged < 143_156 < unpaged


def test_more_steps_per_arm_reach_the_launch_line_and_rerun_records_of_another_count(
        tmp_path, monkeypatch, capsys):
    """``--train-iters 12``: ten steady steps for a step-time comparison; a record of the
    default five steps is another launch line, so it runs again; fewer than 3 is refused."""
    monkeypatch.setattr(bench_scale, "require_gpu", lambda benchmark: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_scale, "scale_header", lambda: {
        "benchmark": "scale", "gpu": "H200", "date": "today", "commit": "new"})
    layout = LAYOUTS["qwen3_235b"]
    five = {"layout": "qwen3_235b", "rank": 0, "stage": 0, "arm": "unpaged",
            "capacity_factor": 2.0, "status": "out of memory",
            "flags": bench_scale.arm_argv(layout, 0, "unpaged", 2.0)[0]}
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"benchmark": "scale", "commit": "old", "date": "then",
                               "arm_naming": "plan_arm[.variant]", "runs": [five]}))
    launched = []
    monkeypatch.setattr(bench_scale.subprocess, "run", lambda cmd, **kw: (
        launched.append(cmd[cmd.index("--train-iters") + 1]), subprocess.CompletedProcess(
            cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory"))[1])
    argv = ["--layouts", "qwen3_235b", "--arms", "unpaged", "--capacity-factors", "2.0",
            "--out", str(out)]
    assert bench_scale.main(argv) == 0 and launched == ["5"]  # rank 224 only: rank 0 is kept
    assert bench_scale.main([*argv, "--train-iters", "12"]) == 0
    assert launched == ["5", "12", "12"]  # both ranks again, at 12 steps
    with pytest.raises(SystemExit):
        bench_scale.main([*argv, "--train-iters", "2"])
    assert "--train-iters must be >= 3" in capsys.readouterr().err


def test_a_profiled_arm_keeps_its_timeline_and_leaves_the_profiled_steps_out_of_its_median(
        tmp_path, monkeypatch):
    # The example's timeline record of the profiled iteration (tools/kernel_timeline.py rows:
    # [name index, stream, start us, duration us]): a GEMM, then a paging kernel alone for 2 ms.
    timeline = {"iteration": 4, "wall_ms": 9.0, "names": ["gemm", "paging_bulk_kernel"],
                "rows": [[0, 7, 0.0, 5000.0], [1, 9, 3000.0, 4000.0], [0, 7, 7000.0, 1000.0]],
                "launch_us": [0.0, 1.0, 2.0]}
    report = [line for line in LOG.splitlines() if "elapsed time" not in line]
    slow_log = "\n".join([ITER.format(3, 2000.0), ITER.format(4, 2600.0),
                          ITER.format(5, 2500.0), ITER.format(6, 2100.0), *report])

    def fake_run(cmd, **kwargs):
        env = kwargs.get("env")
        if env is None:
            return subprocess.CompletedProcess(cmd, 0, "", "")
        assert env["MEGATRON_PAGING_BENCH_PROFILE_ITER"] == "4"
        Path(f"{env['MEGATRON_PAGING_BENCH_PROFILE_JSON']}.rank{env['RANK']}").write_text(
            json.dumps(timeline))
        return subprocess.CompletedProcess(cmd, 0, slow_log, "")

    monkeypatch.setattr(bench_scale.subprocess, "run", fake_run)
    layout = LAYOUTS["qwen3_235b"]
    record = bench_scale.run_arm(layout, layout.ranks[0], "unpaged", 2.0, tmp_path, timeout=10,
                                 train_iters=6, profile_iteration=4,
                                 profile_dir=tmp_path / "timelines")
    profile = record["profile"]
    assert profile["paging_sum_ms"] == 4.0 and profile["paging_hidden_ms"] == 2.0
    assert profile["exposed_paging"]["exposed_ms"] == 2.0  # 5-7 ms: paging alone, GEMM queued
    assert profile["exposed_paging"]["queued_ms"] == 2.0
    assert (tmp_path / "timelines" / profile["timeline"]).exists()
    assert record["median_steady_iteration_ms"] == 2050.0  # steps 3 and 6: not 4 and 5
    assert "profile it 4" in bench_scale.profile_line(profile)
    # A record profiled otherwise (or not at all) runs again.
    record.update(layout=layout.name)
    planned = [(layout.name, layout.ranks[0], "unpaged", 2.0)]
    monkeypatch.setattr(bench_scale, "arm_argv", lambda *a: (record["flags"], None))
    assert bench_scale.stale_runs([record], planned, 6, None) == set(planned)
    assert bench_scale.stale_runs([record], planned, 6, 4) == set()


def test_profile_iteration_outside_the_steady_steps_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        bench_scale.main(["--profile-iteration", "5", "--train-iters", "5"])
    assert "--profile-iteration must be in [3, --train-iters)" in capsys.readouterr().err
