"""CPU: benchmarks/bench_frontier.py without a GPU: the arm and size tables, the live-byte
arithmetic, log parsing, targets and the resumed file's memory split (the budget search and the
driver are in test_bench_frontier_budget.py and test_bench_frontier_driver.py)."""

from __future__ import annotations

import json

import frontier_bench  # noqa: F401 (a plain import, so sorted first: puts benchmarks/ on sys.path)
import pytest
from frontier.arms import (
    ARMS,
    DEFAULT_ARMS,
    IMPLEMENTATION_ENV,
    PAGED_FAMILY,
    RECOMPUTE_INFORMATIONAL,
    SIZES,
    budget_extra,
    estimate_memory,
    expert_bytes,
    frontier_extra,
    model_config,
    resolve_flags,
    script_argv,
)
from frontier.logs import (
    call_of_runs,
    classify,
    memory_split,
    parity,
    parse_iterations,
    parse_report,
    refresh_memory_split,
    removed_runs,
    steady_step_ms,
    summarize,
)
from frontier.plan import frontier_tasks, load_runs
from frontier.report import table as report_table
from frontier.targets import evaluate_targets

MIB = 2**20


def _cfg(**over):
    cfg = model_config(script_argv([], paged=False))
    cfg.update(over)
    return cfg


# ----------------------------------------------------------------------------- tables, flags


def test_arm_table_and_flags():
    assert [a for a, arm in ARMS.items() if arm.exact] == [
        "paged", "paged.hold", "mcore", "offload", "paged_offload_experts.no_stash",
        "paged_offload", "unpaged.recompute_fc1", "paged_recompute_fc1",
        "paged_recompute_fc1.hold", "paged_recompute_fc1.tight", "paged_recompute_fc1.spill",
        "paged_offload_experts.recompute_fc1_no_stash"]
    assert not ARMS["unpaged"].paged and not ARMS["recompute"].paged
    assert ARMS["paged.recompute_core_attn"].paged
    assert set(DEFAULT_ARMS) <= set(ARMS) and DEFAULT_ARMS[0] == "unpaged"
    # Benchmark controls are environment variables, never flags of the library.
    assert ARMS["mcore"].env == {IMPLEMENTATION_ENV: "mcore"}
    assert ARMS["mcore"].flags == ()
    assert {a for a, arm in ARMS.items() if arm.env} == {"mcore"}
    assert not any(flag.startswith("--paging-") and flag not in (
        "--paging-hold-last-slot", "--paging-recompute-expert-fc1", "--paging-offload-backend")
        for arm in ARMS.values() for flag in arm.flags)
    assert set(PAGED_FAMILY) <= set(ARMS) and set(RECOMPUTE_INFORMATIONAL) <= set(ARMS)
    # the pool arms' factors win over the script's 1.10 (argparse: the last value)
    tight = resolve_flags(script_argv(frontier_extra("moe_compute", "paged_recompute_fc1.tight"),
                                      paged=True))
    assert tight["--moe-paged-stash-buffer-size-factor-cuda"] == ["1.0"]
    assert "--paging-hold-last-slot" in tight
    spill = resolve_flags(script_argv(frontier_extra("moe_compute", "paged_recompute_fc1.spill"),
                                      paged=True))
    assert spill["--moe-paged-stash-buffer-size-factor-cuda"] == ["0.72"]
    assert spill["--moe-paged-stash-buffer-size-factor-cpu"] == ["0.3"]
    assert "paged_recompute_fc1.spill" in RECOMPUTE_INFORMATIONAL
    assert "paged_recompute_fc1.spill" not in PAGED_FAMILY
    assert ARMS["unpaged.unfused"].flags == ("--no-bias-swiglu-fusion",)
    assert ARMS["paged.hold"].paged and ARMS["paged.hold"].exact
    # layernorm recompute needs TE in Megatron-Core 0.19.2: no arm asks for it.
    assert not any("layernorm" in arm.flags for arm in ARMS.values())
    extra = frontier_extra("expert_heavy", "recompute", iters=7)
    assert extra[-3:] == ["--deterministic-mode", "--train-iters", "7"]
    flags = resolve_flags(extra)
    assert flags["--recompute-modules"] == ["moe"]
    assert flags["--num-experts"] == ["32"]
    # Budget candidates override the size's sequence length (the later flag wins).
    flags = resolve_flags(budget_extra("expert_heavy", "paged", 12288))
    assert flags["--seq-length"] == ["12288"] and flags["--max-position-embeddings"] == ["12288"]


def test_script_argv_is_what_the_example_gets():
    paged = script_argv(frontier_extra("expert_heavy", "mcore"), paged=True)
    cfg = model_config(paged)
    assert (cfg["seq_length"], cfg["num_experts"], cfg["moe_router_topk"]) == (4096, 32, 4)
    assert cfg["moe_ffn_hidden_size"] == 2048 and cfg["capacity_factor"] == 1.5
    assert cfg["paged"] and cfg["swiglu"] and cfg["dtype_bytes"] == 2
    assert cfg["microbatches"] == 8
    assert "--paging-implementation" not in resolve_flags(paged)  # an env var now
    unpaged = model_config(script_argv(frontier_extra("small", "unpaged"), paged=False))
    assert not unpaged["paged"] and unpaged["seq_length"] == 2048
    recompute = script_argv(frontier_extra("small", "paged.recompute_core_attn"), paged=True)
    assert model_config(recompute)["recompute_modules"] == ["core_attn"]
    assert resolve_flags(recompute)["--recompute-granularity"] == ["selective"]


def test_tasks_carry_the_arms_controls_and_the_calls_env():
    tasks = frontier_tasks(["small"], list(ARMS), None, {}, 12,
                           env={"CUDA_DEVICE_MAX_CONNECTIONS": "32"})
    assert len(tasks) == len(ARMS) and tasks[0].key == "small:unpaged"
    by_arm = {t.arm: t for t in tasks}
    assert by_arm["mcore"].env == {IMPLEMENTATION_ENV: "mcore",
                                   "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert by_arm["paged"].env == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}


# ----------------------------------------------------------------------------- arithmetic


def test_live_expert_bytes_of_the_example():
    e = expert_bytes(_cfg())
    # The example: top-2 of 2048 tokens = 4096 rows, capacity 1.5x = 6144, (1024 + 2 x 1024) bf16,
    # 8 layers, one microbatch in flight (PP = 1): 192 MiB live, 288 MiB of capacity buffers.
    assert (e["routed_rows_per_layer"], e["capacity_rows_per_layer"]) == (4096, 6144)
    assert e["row_bytes"] == 6144
    assert e["live_expert_mib"] == pytest.approx(192.0)
    assert e["capacity_expert_mib"] == pytest.approx(288.0)
    assert e["one_layer_capacity_mib"] == pytest.approx(36.0)
    assert e["paged_bound_mib"] == pytest.approx(1.1 * 192 + 36)
    heavy = expert_bytes(model_config(script_argv(
        frontier_extra("expert_heavy", "paged"), paged=True)))
    assert heavy["live_expert_mib"] == pytest.approx(16384 * 10240 * 8 / MIB)  # 1280 MiB
    assert heavy["capacity_rows_per_layer"] == 24576
    # No SwiGLU: fc1 is moe_ffn wide. Micro-batch 2 doubles the rows.
    assert expert_bytes(_cfg(swiglu=False))["row_bytes"] == (1024 + 1024) * 2
    assert expert_bytes(_cfg(micro_batch_size=2))["live_expert_mib"] == pytest.approx(384.0)
    # The experts saving x only (fc1 recomputed): hidden columns alone, read from the arm's flags.
    fc1 = model_config(script_argv(frontier_extra("moe_compute", "paged_recompute_fc1"), True))
    assert fc1["recompute_expert_fc1"] and expert_bytes(fc1)["row_bytes"] == 1024 * 2
    assert expert_bytes(fc1)["live_expert_mib"] == pytest.approx(65536 * 2048 * 8 / MIB)
    # 1F1B on the first of 4 stages: 2 layers, 4 microbatches in flight.
    pp = expert_bytes(_cfg(pipeline_parallel=4))
    assert (pp["layers_in_flight"], pp["microbatches_in_flight"]) == (2, 4)
    assert pp["live_expert_mib"] == pytest.approx(192.0)
    with pytest.raises(ValueError, match="EP = 1"):
        expert_bytes(_cfg(expert_parallel=2))


def test_sizes_fit_one_h200_and_experts_dominate_where_claimed():
    h200 = 141e9
    shares = {}
    for name in SIZES:
        cfg = model_config(script_argv(frontier_extra(name, "unpaged"), paged=False))
        est = estimate_memory(cfg)
        assert est["total_bytes"] < 0.5 * h200, name
        shares[name] = est["expert_capacity_bytes"] / est["non_expert_layers_bytes"]
    assert shares["expert_heavy"] > 1.5  # expert activations dominate the per-layer ones
    assert shares["small"] < 1.0  # not at the example's size
    params = estimate_memory(_cfg())["params"]
    assert 0.45e9 < params < 0.55e9  # the arithmetic in the comments: ~0.50B


# ----------------------------------------------------------------------------- log parsing


def _log(ms=(5000.0, 2000.0, 1500.0, 1000.0, 1010.0, 990.0), report=True, steady=9000.0,
         fb=None):
    lines = ["using world size: 1"]
    for i, m in enumerate(ms, 1):
        lines.append(
            f" [2026-12-01 03:33:42] iteration {i:8d}/{len(ms):8d} | consumed samples: {8 * i} | "
            f"elapsed time per iteration (ms): {m:.1f} | learning rate: 1.0E-04 | global batch "
            f"size:     8 | lm loss: 1.03892{i}E+01 | loss scale: 1.0 | grad norm: 3.12{i} | "
            "number of skipped iterations:   0 |")
    if report:
        lines.append(
            f"paging-example rank 0: peak_allocated_mib={steady + 50:.1f} "
            f"steady_peak_allocated_mib={steady:.1f} "
            + (f"steady_fb_peak_allocated_mib={fb:.1f} " if fb is not None else "")
            + f"peak_reserved_mib={steady + 500:.1f} "
            "pool_cuda_mib=211.5 pool_host_mib=0.0 param_mib=1000.0 grad_mib=1000.0 "
            "optimizer_state_mib=6000.0 paging_mode=paged paged_steps=6 graph_replays=0 "
            "overflow_actions=-")
    return "\n".join(lines) + "\n"


def test_parse_megatron_log_and_memory_split():
    text = _log()
    its = parse_iterations(text)
    assert [r["iteration"] for r in its] == [1, 2, 3, 4, 5, 6]
    assert its[0]["lm_loss"] == "1.038921E+01" and its[5]["grad_norm"] == "3.126"
    assert steady_step_ms(its) == [1000.0, 1010.0, 990.0]  # iterations 1-3 dropped
    report = parse_report(text)
    assert report["steady_peak_allocated_mib"] == 9000.0 and report["paging_mode"] == "paged"
    assert report["overflow_actions"] == "-"
    # An older report without the forward-backward peak: the step peak, and it says so.
    assert memory_split(report) == {"state_mib": 8000.0, "activation_mib": 1000.0,
                                    "activation_source": "steady_peak_allocated_mib"}
    assert memory_split({"param_mib": 1.0}) == {}
    # The step peak set by the optimizer (9000) is not activation memory: the fb peak (8600) is.
    report = parse_report(_log(fb=8600.0))
    assert report["steady_fb_peak_allocated_mib"] == 8600.0
    assert memory_split(report) == {"state_mib": 8000.0, "activation_mib": 600.0,
                                    "activation_source": "steady_fb_peak_allocated_mib"}
    state_only = {"param_mib": 1.0, "grad_mib": 1.0, "optimizer_state_mib": 1.0}
    assert memory_split(state_only) == {}
    assert classify(text, 0, False) == "ok"
    assert classify(_log(report=False), 0, False) == "error"  # exit 0 but no final report
    oom = _log(report=False) + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    assert classify(oom, 1, False) == "oom"
    assert classify(_log(report=False) + "AssertionError: boom", 1, False) == "error"
    assert classify(text, None, True) == "timeout"


def test_parity_is_exact():
    a = [f"{1.5 + i / 8:.17g}" for i in range(4)]
    control = [f"{float(x).hex()} 2048" for x in a]
    assert parity(list(control), control)["bitwise_equal"] is True
    near = list(control)
    near[2] = f"{float.fromhex(control[2].split()[0]) + 2**-40:.17g}"
    near[2] = f"{float(near[2]).hex()} 2048"
    p = parity(near, control)
    assert p["bitwise_equal"] is False and 0 < p["max_rel_loss_diff"] < 1e-9
    short = parity(control[:3], control)
    assert short["bitwise_equal"] is False and short["lengths"] == [3, 4]
    assert parity([], control) is None


# ----------------------------------------------------------------------------- targets


def _row(step, act, spread=0.01, **extra):
    return {"status": "ok", "step_ms": step, "activation_mib": act,
            "step_spread": {"median": step, "min": step * (1 - spread),
                            "max": step * (1 + spread), "relative_spread": spread},
            "live_expert_mib": 1280.0, "one_layer_capacity_mib": 240.0,
            "paged_bound_mib": 1.1 * 1280 + 240, "capacity_expert_mib": 1920.0, **extra}


def test_targets_pass_and_miss_from_numbers():
    eq = {"bitwise_equal": True}
    rows = {
        "unpaged": _row(1000.0, 4000.0),
        "paged": _row(1005.0, 3500.0, parity=eq),
        "mcore": _row(1200.0, 3500.0, parity={"bitwise_equal": False}),
        "recompute": _row(1300.0, 2200.0),
        "paged.recompute_core_attn": _row(1080.0, 2100.0),
        "paged_offload_experts.no_stash": _row(1000.0, 2000.0, parity=eq),
    }
    t = evaluate_targets({"moe_compute": rows})["moe_compute"]
    rec = t["paged_1.2x_faster_than_recompute_at_le_its_activation"]
    assert rec["per_arm"]["paged"]["met"] is False  # faster, but more activation memory
    assert rec["per_arm"]["paged"]["activation_le_recompute"] is False
    assert rec["per_arm"]["paged.recompute_core_attn"]["met"] is True  # 1.204x at 2100 MiB
    assert rec["status"] == "PASS" and rec["required"]
    # Our offloading arm is computed the same way beside the verdict, never in it.
    assert set(rec["per_arm"]) == {"paged", "paged.recompute_core_attn"}
    off = rec["informational_per_arm"]["paged_offload_experts.no_stash"]
    assert off["speedup_vs_recompute"] == pytest.approx(1.3) and off["met"] is True
    assert off["activation_mib"] == 2000.0 and off["recompute_activation_mib"] == 2200.0
    assert "not the strict target" in rec["informational_note"]
    lines = report_table({"gpu": None, "commit": "x", "summary": {"moe_compute": rows},
                          "budget": {"outcomes": {}}, "remaining": [],
                          "targets": {"moe_compute": t}})
    info = [line for line in lines if "informational, not the strict target" in line]
    assert len(info) == 1
    assert "[paged_offload_experts.no_stash: 1.30x, act 2000 vs 2200 MiB: meets]" in info[0]
    verdict = [line for line in lines if "paged_1.2x_faster" in line]
    assert len(verdict) == 1 and verdict[0].startswith("  moe_compute: paged_1.2x")
    assert ": PASS [paged: " in verdict[0] and "MiB: misses]" in verdict[0]
    assert "[paged.recompute_core_attn: 1.20x, act 2100 vs 2200 MiB: meets]" in verdict[0]
    assert any(line.startswith("moe_compute        paged.recompute_core_attn ") for line in lines)
    assert not any("* = from the step peak" in line for line in lines)
    rows["recompute"]["activation_source"] = "steady_peak_allocated_mib"  # an older record
    lines = report_table({"gpu": None, "commit": "x", "summary": {"moe_compute": rows},
                          "budget": {"outcomes": {}}, "remaining": [],
                          "targets": {"moe_compute": t}})
    assert any(line.startswith("moe_compute        recompute ") and "2200.0*" in line
               for line in lines)
    assert any("* = from the step peak" in line for line in lines)
    del rows["recompute"]["activation_source"]
    rows_off = {k: v for k, v in rows.items() if k != "paged.recompute_core_attn"}
    rec_off = evaluate_targets({"moe_compute": rows_off})["moe_compute"][
        "paged_1.2x_faster_than_recompute_at_le_its_activation"]
    assert rec_off["status"] == "MISS"  # a passing informational arm does not pass the target
    assert rec_off["informational_per_arm"]["paged_offload_experts.no_stash"]["met"]
    act = t["paged_activation_le_1.1x_live_plus_one_layer"]
    assert act["bound_mib"] == pytest.approx(1648.0)
    assert act["met"] is False and act["status"] == "MISS"  # 3500 MiB of all activations
    assert act["non_expert_activation_mib"] == pytest.approx(4000.0 - 1920.0)
    assert act["expert_activation_mib"] == pytest.approx(3500.0 - 2080.0)
    assert act["expert_share_met"] is True
    over = t["paged_step_le_1.01x_unpaged"]
    assert over["ratio"] == pytest.approx(1.005) and over["status"] == "PASS"
    assert over["within_noise"] is True  # 0.5% from the limit, 2% of spread
    assert t["paged_step_le_0.9x_mcore"]["status"] == "PASS"
    assert t["bitwise_parity_of_exact_arms"]["status"] == "MISS"
    assert t["paged_step_peak_le_unpaged_step_peak"] == {
        "status": "NOT RUN", "met": None, "informational": True}  # rows without step peaks
    # Slower paging misses; a missing arm is NOT RUN, not a pass.
    rows["paged"] = _row(1100.0, 3500.0, spread=0.001, parity=eq)
    del rows["mcore"]
    t = evaluate_targets({"small": rows})["small"]
    assert t["paged_step_le_1.01x_unpaged"]["status"] == "MISS"
    assert not t["paged_step_le_1.01x_unpaged"]["within_noise"]
    assert t["paged_step_le_0.9x_mcore"]["status"] == "NOT RUN"
    assert not t["paged_1.2x_faster_than_recompute_at_le_its_activation"]["required"]
    assert evaluate_targets({"small": {}})["small"][
        "paged_activation_le_1.1x_live_plus_one_layer"]["status"] == "NOT RUN"


def test_step_ratios_across_device_calls_are_no_verdict():
    """A GPU's step time drifts between calls by more than paging costs: a resumed file's arms
    from two calls give no PASS or MISS."""
    rows = {
        "unpaged": _row(2015.0, 4000.0, call=1),
        "paged": _row(2023.2, 3500.0, call=0),  # 1.004x "unpaged" of another call
        "paged.hold": _row(2078.1, 3500.0, call=1),
        "recompute": _row(2600.0, 3600.0, call=1),
    }
    t = evaluate_targets({"moe_compute": rows})["moe_compute"]
    step = t["paged_step_le_1.01x_unpaged"]
    assert step["status"] == "NOT COMPARABLE" and step["met"] is None
    assert step["ratio"] == pytest.approx(2023.2 / 2015.0)
    assert "different device calls (0, 1)" in step["reason"]
    same = step["same_model_per_arm"]["paged.hold"]  # one call: a verdict
    assert same["status"] == "MISS" and same["ratio"] == pytest.approx(2078.1 / 2015.0)
    rec = t["paged_1.2x_faster_than_recompute_at_le_its_activation"]["per_arm"]
    assert set(rec) == {"paged.hold"}  # paged ran in the other call
    lines = report_table({"gpu": None, "commit": "x", "summary": {"moe_compute": rows},
                          "budget": {"outcomes": {}}, "remaining": [],
                          "targets": {"moe_compute": t}})
    assert any(line.startswith("  moe_compute: paged_step_le_1.01x_unpaged: NOT COMPARABLE "
                               "(ratio 1.004: paged and unpaged ran in different device calls")
               for line in lines)
    # Rows of one call, or of files whose calls do not say, keep their verdict.
    for call in (1, None):
        rows["paged"]["call"] = call
        step = evaluate_targets({"moe_compute": rows})["moe_compute"][
            "paged_step_le_1.01x_unpaged"]
        assert step["status"] == "PASS"
    # Where the calls say it: the last call that ran a key measured it.
    calls = [{"ran": ["moe_compute:paged", "moe_compute:unpaged"]},
             {"ran": ["moe_compute:unpaged"]}, {}]
    assert call_of_runs(calls) == {"moe_compute:paged": 0, "moe_compute:unpaged": 1}


def test_same_model_step_ratios_sit_beside_the_strict_verdict():
    rows = {
        "unpaged": _row(1000.0, 4000.0, spread=0.002),
        "paged": _row(1030.0, 3500.0, spread=0.002),
        "unpaged.recompute_fc1": _row(1020.0, 3000.0, spread=0.002),
        "paged_recompute_fc1.tight": _row(1025.0, 2500.0, spread=0.002),
        "paged_recompute_fc1": _row(1040.0, 2800.0, spread=0.002),
        "paged.hold": _row(1031.0, 3300.0, spread=0.002),
    }
    step = evaluate_targets({"moe_compute": rows})["moe_compute"]["paged_step_le_1.01x_unpaged"]
    assert step["status"] == "MISS" and step["ratio"] == pytest.approx(1.03)
    same = step["same_model_per_arm"]
    # Each paged arm against the unpaged arm of its own model; "paged" is the verdict itself.
    assert set(same) == {"paged_recompute_fc1.tight", "paged_recompute_fc1", "paged.hold"}
    tight = same["paged_recompute_fc1.tight"]
    assert tight["unpaged_arm"] == "unpaged.recompute_fc1" and tight["status"] == "PASS"
    assert tight["ratio"] == pytest.approx(1025.0 / 1020.0)
    assert same["paged_recompute_fc1"]["status"] == "MISS"  # 1.0196x
    assert same["paged.hold"]["unpaged_arm"] == "unpaged" and same["paged.hold"]["met"] is False
    lines = report_table({"gpu": None, "commit": "x", "summary": {"moe_compute": rows},
                          "budget": {"outcomes": {}}, "remaining": [],
                          "targets": {"moe_compute": evaluate_targets(
                              {"moe_compute": rows})["moe_compute"]}})
    assert any(line.startswith("  moe_compute: paged_step_le_1.01x_unpaged: MISS")
               for line in lines)
    assert ("  moe_compute:   informational, same model: [paged_recompute_fc1.tight vs "
            "unpaged.recompute_fc1: 1.005x]: PASS") in lines
    # The activation bound, per arm: the non-expert part from the unpaged arm of its model.
    act = evaluate_targets({"moe_compute": rows})["moe_compute"][
        "paged_activation_le_1.1x_live_plus_one_layer"]
    assert act["status"] == "MISS"  # the verdict still reads paged: 3500 MiB of activation
    shares = act["same_model_per_arm"]
    assert set(shares) == {"paged_recompute_fc1.tight", "paged_recompute_fc1", "paged.hold"}
    tight = shares["paged_recompute_fc1.tight"]
    assert tight["non_expert_activation_mib"] == pytest.approx(3000.0 - 1920.0)
    assert tight["expert_activation_mib"] == pytest.approx(2500.0 - 1080.0)
    assert tight["bound_mib"] == pytest.approx(1648.0) and tight["status"] == "PASS"
    assert shares["paged_recompute_fc1"]["status"] == "MISS"  # 1720 > 1648
    assert shares["paged.hold"]["expert_activation_mib"] == pytest.approx(3300.0 - 2080.0)
    assert ("  moe_compute:   informational, same model: [paged_recompute_fc1: expert share "
            "1720 MiB vs bound 1648 MiB (non-expert from unpaged.recompute_fc1)]: MISS") in lines
    # Without the same-model control the pair is left out, not passed.
    del rows["unpaged.recompute_fc1"]
    targets = evaluate_targets({"moe_compute": rows})["moe_compute"]
    step = targets["paged_step_le_1.01x_unpaged"]
    assert set(step["same_model_per_arm"]) == {"paged.hold"}
    assert set(targets["paged_activation_le_1.1x_live_plus_one_layer"][
        "same_model_per_arm"]) == {"paged.hold"}


def test_step_peak_target_is_informational():
    # A persistent pool lives through the optimizer step, whose transient sets the step peak.
    rows = {"unpaged": _row(1031.3, 4066.9, steady_peak_allocated_mib=35579.2,
                            steady_fb_peak_allocated_mib=33420.7),
            "paged": _row(1222.2, 3795.2, steady_peak_allocated_mib=36987.4,
                          steady_fb_peak_allocated_mib=33149.0, pool_cuda_mib=1408.1)}
    t = evaluate_targets({"expert_heavy": rows})["expert_heavy"][
        "paged_step_peak_le_unpaged_step_peak"]
    assert t["status"] == "MISS" and t["informational"] is True
    assert t["difference_mib"] == pytest.approx(1408.2) and t["pool_cuda_mib"] == 1408.1
    assert t["paged_fb_peak_mib"] < t["unpaged_fb_peak_mib"]
    rows["paged"]["steady_peak_allocated_mib"] = 35000.0
    assert evaluate_targets({"expert_heavy": rows})["expert_heavy"][
        "paged_step_peak_le_unpaged_step_peak"]["status"] == "PASS"


def test_resumed_file_gets_the_current_split_and_keeps_removed_arms_out(tmp_path):
    mem = {"steady_peak_allocated_mib": 35579.2, "steady_fb_peak_allocated_mib": 33420.7,
           "param_mib": 3261.5, "grad_mib": 6523.1, "optimizer_state_mib": 19569.2}
    runs = {
        "expert_heavy:unpaged": {"kind": "arm", "size": "expert_heavy", "arm": "unpaged",
                                 "status": "ok", "memory": mem, "activation_mib": 6225.4},
        "expert_heavy:gone": {"kind": "arm", "size": "expert_heavy", "arm": "gone",
                              "status": "ok", "memory": {}, "activation_mib": 1.0},
    }
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"benchmark": "frontier", "runs": runs, "calls": []}))
    loaded, calls = load_runs(path)
    unpaged = loaded["expert_heavy:unpaged"]
    assert unpaged["activation_mib"] == pytest.approx(33420.7 - 29353.8)
    assert unpaged["activation_source"] == "steady_fb_peak_allocated_mib"
    assert "activation_mib" not in loaded["expert_heavy:gone"]  # nothing measured: no split
    assert set(summarize(loaded)["expert_heavy"]) == {"unpaged"}
    removed = removed_runs(loaded)
    assert removed["expert_heavy:gone"]["reason"] == "not an arm of this tree"
    assert refresh_memory_split({}) == {}
