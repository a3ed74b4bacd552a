"""CPU: benchmarks/bench_frontier.py without a GPU: the arm and size tables, the live-byte
arithmetic, log parsing, targets, the budget search, resume/selection, the time-budget decision,
and the whole driver against a fake example script that prints Megatron-shaped logs."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"


def _load():
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # common.py and the frontier/ package
    spec = importlib.util.spec_from_file_location("bench_frontier", BENCH_DIR / "bench_frontier.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_frontier"] = module  # as an import would register it
    spec.loader.exec_module(module)
    return module


bf = _load()  # the entry point: main() and its glue; the rest is in benchmarks/frontier/
from frontier import arms as frontier_arms  # noqa: E402 (benchmarks/ is on sys.path now)
from frontier.arms import (  # noqa: E402
    ARMS,
    PAGED_FAMILY,
    REMOVED_ARMS,
    SIZES,
    budget_extra,
    estimate_memory,
    expert_bytes,
    frontier_extra,
    model_config,
    offload_available,
    resolve_flags,
    script_argv,
    skip_reason,
)
from frontier.budget import (  # noqa: E402
    BudgetOptions,
    budget_env,
    budget_outcome,
    budget_records,
    next_budget_task,
    next_candidate,
    predict_start,
    probe_task,
    run_budget,
)
from frontier.logs import (  # noqa: E402
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
from frontier.plan import (  # noqa: E402
    DEFAULT_RUN_S,
    ESTIMATE_MARGIN,
    Task,
    estimate_run_s,
    fits,
    frontier_tasks,
    load_runs,
    parse_only,
    remaining,
)
from frontier.report import table as report_table  # noqa: E402
from frontier.targets import budget_target, evaluate_targets  # noqa: E402

MIB = 2**20


def _cfg(**over):
    cfg = model_config(script_argv([], paged=False))
    cfg.update(over)
    return cfg


# ----------------------------------------------------------------------------- tables, flags


def test_arm_table_and_flags():
    assert [a for a, arm in ARMS.items() if arm.exact] == [
        "paged", "paged_hold", "paged_persistent", "paged_unbounded_lead", "mcore_manager",
        "mcore_offload", "paged_offload", "paged_stash_plus_offload"]
    assert ARMS["paged_unbounded_lead"].flags == ("--paging-max-inflight-stashes", "0")
    assert {a for a, arm in ARMS.items() if arm.needs_offload} == {
        "mcore_offload", "paged_offload", "paged_stash_plus_offload"}
    assert not ARMS["unpaged"].paged and not ARMS["recompute_moe"].paged
    assert ARMS["paged_recompute_core_attn"].paged
    assert PAGED_FAMILY == ("paged", "paged_hold", "paged_recompute_core_attn")
    assert ARMS["paged_hold"].paged and ARMS["paged_hold"].exact
    # layernorm recompute needs TE in Megatron-Core 0.19.2: the arm is gone, and says why.
    assert "paged_recompute_attn_norm" not in ARMS
    assert "CheckpointWithoutOutput" in REMOVED_ARMS["paged_recompute_attn_norm"]
    assert not any("layernorm" in arm.flags for arm in ARMS.values())
    extra = frontier_extra("expert_heavy", "recompute_moe", iters=7)
    assert extra[-3:] == ["--deterministic-mode", "--train-iters", "7"]
    flags = resolve_flags(extra)
    assert flags["--recompute-modules"] == ["moe"]
    assert flags["--num-experts"] == ["32"]
    # Budget candidates override the size's sequence length (the later flag wins).
    flags = resolve_flags(budget_extra("expert_heavy", "paged", 12288))
    assert flags["--seq-length"] == ["12288"] and flags["--max-position-embeddings"] == ["12288"]


def test_script_argv_is_what_the_example_gets():
    paged = script_argv(frontier_extra("expert_heavy", "mcore_manager"), paged=True)
    cfg = model_config(paged)
    assert (cfg["seq_length"], cfg["num_experts"], cfg["moe_router_topk"]) == (4096, 32, 4)
    assert cfg["moe_ffn_hidden_size"] == 2048 and cfg["capacity_factor"] == 1.5
    assert cfg["paged"] and cfg["swiglu"] and cfg["dtype_bytes"] == 2
    assert cfg["microbatches"] == 8
    assert resolve_flags(paged)["--paging-implementation"] == ["mcore"]
    unpaged = model_config(script_argv(frontier_extra("small", "unpaged"), paged=False))
    assert not unpaged["paged"] and unpaged["seq_length"] == 2048
    recompute = script_argv(frontier_extra("small", "paged_recompute_core_attn"), paged=True)
    assert model_config(recompute)["recompute_modules"] == ["core_attn"]
    assert resolve_flags(recompute)["--recompute-granularity"] == ["selective"]


def test_offload_arms_wait_for_the_flag(tmp_path):
    without, with_flag = tmp_path / "a.py", tmp_path / "b.py"
    without.write_text('"--paging-core-attention"\n')
    with_flag.write_text('group.add_argument("--paging-offload-backend")\n')
    assert not offload_available(without) and offload_available(with_flag)
    assert not offload_available(tmp_path / "missing.py")
    assert "--paging-offload-backend" in skip_reason(ARMS["paged_offload"], False)
    assert skip_reason(ARMS["paged_offload"], True) is None
    assert skip_reason(ARMS["paged"], False) is None
    tasks, skipped = frontier_tasks(["small"], list(ARMS), None, {}, 12, offload=False)
    assert set(skipped) == {"small:mcore_offload", "small:paged_offload",
                            "small:paged_stash_plus_offload"}
    assert len(tasks) == 8
    tasks, skipped = frontier_tasks(["small"], list(ARMS), None, {}, 12, offload=True)
    assert not skipped and len(tasks) == 11


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
        "mcore_manager": _row(1200.0, 3500.0, parity={"bitwise_equal": False}),
        "recompute_moe": _row(1300.0, 2200.0),
        "paged_recompute_core_attn": _row(1080.0, 2100.0),
        "paged_offload": _row(1000.0, 2000.0, parity=eq),
    }
    t = evaluate_targets({"expert_heavy": rows})["expert_heavy"]
    rec = t["paged_1.2x_faster_than_recompute_moe_at_le_its_activation"]
    assert rec["per_arm"]["paged"]["met"] is False  # faster, but more activation memory
    assert rec["per_arm"]["paged"]["activation_le_recompute"] is False
    assert rec["per_arm"]["paged_recompute_core_attn"]["met"] is True  # 1.204x at 2100 MiB
    assert rec["status"] == "PASS" and rec["required"]
    # Our offloading arm is computed the same way beside the verdict, never in it.
    assert set(rec["per_arm"]) == {"paged", "paged_recompute_core_attn"}
    off = rec["informational_per_arm"]["paged_offload"]
    assert off["speedup_vs_recompute_moe"] == pytest.approx(1.3) and off["met"] is True
    assert off["activation_mib"] == 2000.0 and off["recompute_activation_mib"] == 2200.0
    assert "not the strict target" in rec["informational_note"]
    lines = report_table({"gpu": None, "commit": "x", "summary": {"expert_heavy": rows},
                          "budget": {"outcomes": {}}, "skipped": {}, "remaining": [],
                          "targets": {"expert_heavy": t}})
    info = [line for line in lines if "informational, not the strict target" in line]
    assert len(info) == 1 and "[paged_offload: 1.30x, act 2000 vs 2200 MiB]" in info[0]
    assert any(line.startswith("expert_heavy       paged_recompute_core_attn ") for line in lines)
    assert not any("* = from the step peak" in line for line in lines)
    rows["recompute_moe"]["activation_source"] = "steady_peak_allocated_mib"  # an older record
    lines = report_table({"gpu": None, "commit": "x", "summary": {"expert_heavy": rows},
                          "budget": {"outcomes": {}}, "skipped": {}, "remaining": [],
                          "targets": {"expert_heavy": t}})
    assert any(line.startswith("expert_heavy       recompute_moe ") and "2200.0*" in line
               for line in lines)
    assert any("* = from the step peak" in line for line in lines)
    del rows["recompute_moe"]["activation_source"]
    rows_off = {k: v for k, v in rows.items() if k != "paged_recompute_core_attn"}
    rec_off = evaluate_targets({"expert_heavy": rows_off})["expert_heavy"][
        "paged_1.2x_faster_than_recompute_moe_at_le_its_activation"]
    assert rec_off["status"] == "MISS" and rec_off["informational_per_arm"]["paged_offload"][
        "met"]  # a passing informational arm does not pass the target
    act = t["paged_activation_le_1.1x_live_plus_one_layer"]
    assert act["bound_mib"] == pytest.approx(1648.0)
    assert act["met"] is False and act["status"] == "MISS"  # 3500 MiB of all activations
    assert act["non_expert_activation_mib"] == pytest.approx(4000.0 - 1920.0)
    assert act["expert_activation_mib"] == pytest.approx(3500.0 - 2080.0)
    assert act["expert_share_met"] is True
    over = t["paged_step_le_1.01x_unpaged"]
    assert over["ratio"] == pytest.approx(1.005) and over["status"] == "PASS"
    assert over["within_noise"] is True  # 0.5% from the limit, 2% of spread
    assert t["paged_step_le_0.9x_mcore_manager"]["status"] == "PASS"
    assert t["bitwise_parity_of_exact_arms"]["status"] == "MISS"
    assert t["paged_step_peak_le_unpaged_step_peak"] == {
        "status": "NOT RUN", "met": None, "informational": True}  # rows without step peaks
    # Slower paging misses; a missing arm is NOT RUN, not a pass.
    rows["paged"] = _row(1100.0, 3500.0, spread=0.001, parity=eq)
    del rows["mcore_manager"]
    t = evaluate_targets({"small": rows})["small"]
    assert t["paged_step_le_1.01x_unpaged"]["status"] == "MISS"
    assert not t["paged_step_le_1.01x_unpaged"]["within_noise"]
    assert t["paged_step_le_0.9x_mcore_manager"]["status"] == "NOT RUN"
    assert not t["paged_1.2x_faster_than_recompute_moe_at_le_its_activation"]["required"]
    assert evaluate_targets({"small": {}})["small"][
        "paged_activation_le_1.1x_live_plus_one_layer"]["status"] == "NOT RUN"


def test_step_peak_target_is_informational():
    # The H200's expert_heavy numbers: the pool lives through the optimizer step's peak.
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
        "expert_heavy:paged_recompute_attn_norm": {
            "kind": "arm", "size": "expert_heavy", "arm": "paged_recompute_attn_norm",
            "status": "error", "memory": {}},
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
    assert removed["expert_heavy:paged_recompute_attn_norm"]["reason"].startswith("replaced by")
    assert removed["expert_heavy:gone"]["reason"] == "not an arm of this tree"
    assert refresh_memory_split({}) == {}


def test_budget_target():
    u = {"max_seq": 12288, "time_per_token_us": 10.0, "concluded": True}
    p = {"max_seq": 14336, "time_per_token_us": 10.05, "concluded": True}
    t = budget_target({"unpaged": u, "paged": p})
    assert t["status"] == "PASS" and t["longer"] and t["concluded"]
    assert budget_target({"unpaged": u, "paged": {**p, "max_seq": 12288}})["status"] == "MISS"
    slow = budget_target({"unpaged": u, "paged": {**p, "time_per_token_us": 10.2}})
    assert slow["status"] == "MISS"
    assert budget_target({"unpaged": u})["status"] == "NOT RUN"


# ----------------------------------------------------------------------------- budget search


def _search(limit, start, ratio, resolution=1024, unit=512, max_runs=8, max_seq=65536):
    tried = {}
    while (s := next_candidate(tried, start, ratio, resolution, unit, max_runs,
                               max_seq)) is not None:
        assert s % unit == 0 and s not in tried and s <= max_seq
        tried[s] = s <= limit
    return tried


@pytest.mark.parametrize("limit", [3000, 4096, 9000, 12800, 30000, 70000])
def test_doubling_then_bisection_finds_the_limit(limit):
    tried = _search(limit, 4096, 1.0)
    fits = [s for s, ok in tried.items() if ok]
    fails = [s for s, ok in tried.items() if not ok]
    if limit >= 65536:
        assert max(fits) == 65536 and not fails  # capped at max_seq
        return
    if limit < 4096:
        assert max(fits) == 2048  # halved until one fits; 2048..4096 then bisected
    assert max(fits) <= limit < min(fails)
    assert min(fails) - max(fits) <= 1024 or len(tried) == 8


def test_search_limits_runs_and_gives_up_when_nothing_fits():
    tried = _search(20000, 16384, 0.25, max_runs=3)
    assert len(tried) == 3
    tried = _search(100, 4096, 1.0)
    assert not any(tried.values()) and min(tried) == 512  # down to one unit, then over


def test_predicted_start():
    rec = {"status": "ok", "seq": 4096, "activation_mib": 4096.0, "state_mib": 8000.0,
           "key": "expert_heavy:unpaged"}
    s = predict_start(rec, 40960.0, 4096, 512, 65536)
    # usable = 0.97 x 40960 - 8000 = 31731 MiB at 1 MiB per token -> 31731 -> 31232
    assert s["start"] == 31232 and s["step_ratio"] == 0.125
    assert s["predicted_from"] == "expert_heavy:unpaged"
    assert predict_start(None, 40960.0, 4096, 512, 65536) == {
        "start": 4096, "step_ratio": 1.0, "predicted_seq": None, "predicted_from": None}
    assert predict_start({**rec, "state_mib": 50000.0}, 40960.0, 4096, 512, 65536)[
        "start"] == 512


def _budget_record(opts, arm, seq, status, search, step=1000.0):
    task = Task("budget", opts.size, arm, tuple(budget_extra(opts.size, arm, seq)),
                opts.iters, seq, budget_env(opts, 0.25), search, opts.cap_gib)
    return {"key": task.key, "kind": "budget", "size": opts.size, "arm": arm, "seq": seq,
            "env": {"PAGED": "1", **task.env},
            "train_iters": opts.iters, "status": status, "cap_gib": opts.cap_gib,
            "search": search, "memory": {}, "wall_s": 60.0,
            "step_ms": {"median": step} if status == "ok" else None,
            "tokens_per_s": seq * 8 / step * 1e3 if status == "ok" else None,
            "time_per_token_us": step * 1e3 / (seq * 8) if status == "ok" else None}


def test_budget_driver_resumes_and_stops_on_errors():
    opts = BudgetOptions(arms=("unpaged", "paged"), max_runs=6)
    limits = {"unpaged": 9000, "paged": 11000}
    runs, calls = {}, []

    def execute(task, label):
        calls.append(task.key)
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search)
        assert task.env["MEGATRON_PAGING_MEMORY_FRACTION"] == f"{opts.cap_gib * 1024 / 143771:.6f}"
        # The cap measures activation memory, not the caching allocator's fragmentation.
        assert task.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert task.key.endswith(":expandable_segments:True")
        return runs[task.key] if len(calls) < 3 else None  # the time budget ends call 1

    assert run_budget(opts, runs, 143771.0, execute, base_seq=4096, offload=False) is False
    assert len(runs) == 3
    first = dict(runs)
    calls.clear()
    limits_hit = {}

    def execute2(task, label):
        assert task.key not in first  # resumed candidates are not run again
        limits_hit[task.key] = True
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search)
        return runs[task.key]

    assert run_budget(opts, runs, 143771.0, execute2, base_seq=4096, offload=False)
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    # Candidates run under another allocator configuration are not this search's.
    plain = BudgetOptions(arms=opts.arms, max_runs=6, alloc_conf="")
    assert budget_records(runs, plain, "unpaged") == []
    assert "PYTORCH_CUDA_ALLOC_CONF" not in budget_env(plain, 0.25)
    assert out["unpaged"]["concluded"] and out["paged"]["concluded"]
    assert out["unpaged"]["max_seq"] <= 9000 < out["unpaged"]["first_failure_above"]
    assert out["paged"]["max_seq"] > out["unpaged"]["max_seq"]
    assert all(len(o["candidates"]) <= 6 for o in out.values())
    assert (out["unpaged"]["max_seq"], out["paged"]["max_seq"]) == (8192, 10240)
    # A candidate that errors (not OOM) stops that arm's search; --retry-failed runs past it.
    runs2 = {}
    err = _budget_record(opts, "unpaged", 4096, "error", predict_start(None, 0, 4096, 512,
                                                                      65536))
    runs2[err["key"]] = err
    assert next_budget_task(opts, runs2, "unpaged", 0.3, 4096) is None
    assert budget_outcome([err], opts)["concluded"] and budget_outcome(
        [err], opts)["errors"] == [4096]
    seen = []

    def execute3(task, label):
        seen.append(task.seq)
        runs2[task.key] = _budget_record(opts, task.arm, task.seq, "ok", task.search)
        return runs2[task.key]

    one = BudgetOptions(arms=("unpaged",), max_runs=1)
    assert run_budget(one, runs2, 143771.0, execute3, retry_failed=True, base_seq=4096,
                      offload=False)
    assert seen == [4096] and runs2[err["key"]]["status"] == "ok"
    # An execute that records nothing cannot loop the search forever.
    assert run_budget(BudgetOptions(arms=("paged",)), {}, 143771.0, lambda t, label: {},
                      base_seq=4096, offload=False) is False


def test_budget_probe_times_each_arm_at_the_controls_longest_length():
    """After its search, an arm runs once more at the control's longest length (its own
    candidates rarely land there), which the target reads as the equal-length comparison."""
    opts = BudgetOptions(arms=("unpaged", "paged", "recompute_moe"), max_runs=4,
                         resolution=512, unit=512)
    limits = {"unpaged": 7424, "paged": 7936, "recompute_moe": 12288}
    # paged is slower per token only where it runs at the cap (the allocator's retries)
    def step_ms(arm, seq):
        return seq * 8 * (40.0 if seq > limits["unpaged"] and arm == "paged" else 30.0) / 1e3

    # paged's search starts from its frontier run (7680 predicted), so its own candidates
    # (7680, 8704, 8192) miss the control's longest; recompute doubles from 4096
    runs = {"expert_heavy:paged": {"kind": "arm", "status": "ok", "seq": 4096,
                                   "activation_mib": 4096.0, "state_mib": 28000.0,
                                   "key": "expert_heavy:paged"}}
    labels = []

    def execute(task, label):
        labels.append(label)
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search, step=step_ms(task.arm, task.seq))
        return runs[task.key]

    assert run_budget(opts, runs, 143771.0, execute, base_seq=4096, offload=False)
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    control_max = out["unpaged"]["max_seq"]
    assert control_max == 7168  # 4096, 8192 OOM, 6144, 7168 (4 runs)
    assert out["paged"]["max_seq"] == 7680 and out["recompute_moe"]["max_seq"] == 12288
    for arm in ("paged", "recompute_moe"):
        assert str(control_max) in out[arm]["candidates"]  # the probe ran
        assert out[arm]["time_per_token_us_by_seq"][str(control_max)] == pytest.approx(30.0)
        assert probe_task(opts, runs, arm, 0.25) is None  # and only once
    assert sum("longest" in label for label in labels) == 2
    assert probe_task(opts, runs, "unpaged", 0.25) is None
    t = budget_target(out)
    assert t["time_per_token_ratio_at_unpaged_max"] == pytest.approx(1.0)
    assert remaining([], runs, out, opts) == []
    # Before the probe has run, what is left says so.
    del runs[next(k for k, r in runs.items() if r.get("arm") == "paged" and r["seq"] == 7168)]
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    assert remaining([], runs, out, opts) == [
        "budget:expert_heavy:paged (not yet timed at unpaged's longest, 7168)"]


# ----------------------------------------------------------------------------- resume, time


def test_selection_resume_and_retry():
    extra = frontier_extra("small", "paged", 12)
    runs = {"small:paged": {"extra": extra, "status": "ok"},
            "small:unpaged": {"extra": frontier_extra("small", "unpaged", 12),
                              "status": "error"},
            "small:recompute_moe": {"extra": ["--train-iters", "3"], "status": "ok"}}
    arms = ["unpaged", "paged", "recompute_moe"]
    keys = [t.key for t in frontier_tasks(["small"], arms, None, runs, 12, False)[0]]
    assert keys == ["small:recompute_moe"]  # other flags: runs again; failed: kept
    keys = [t.key for t in frontier_tasks(["small"], arms, None, runs, 12, False, True)[0]]
    assert keys == ["small:unpaged", "small:recompute_moe"]  # control first
    only = parse_only("small:recompute_moe,expert_heavy:unpaged")
    keys = [t.key for t in frontier_tasks([], [], only, {}, 12, False)[0]]
    assert keys == ["small:recompute_moe", "expert_heavy:unpaged"]
    with pytest.raises(ValueError, match="size:arm"):
        parse_only("small-paged")
    with pytest.raises(ValueError, match="size:arm"):
        parse_only("tiny:paged")
    tasks = frontier_tasks(["small"], arms, None, {}, 12, False)[0]
    left = remaining(tasks, runs, {}, None)
    assert left[0].startswith("small:unpaged (error") and "small:recompute_moe" in left
    assert "small:paged" not in left


def test_time_budget_estimate():
    assert estimate_run_s([], "small", "paged", 12) == pytest.approx(
        DEFAULT_RUN_S * ESTIMATE_MARGIN)
    history = [
        {"size": "small", "arm": "unpaged", "wall_s": 100.0, "train_iters": 12,
         "step_ms": {"median": 1000.0}, "seq": 2048},
        {"size": "small", "arm": "recompute_moe", "wall_s": 110.0, "train_iters": 12,
         "step_ms": {"median": 1500.0}, "seq": 2048},
    ]
    # start-up: the worst of 100 - 12 and 110 - 18 = 92 s; this arm's step, else the worst.
    assert estimate_run_s(history, "small", "unpaged", 12) == pytest.approx(1.15 * (92 + 12))
    assert estimate_run_s(history, "small", "paged", 12) == pytest.approx(1.15 * (92 + 18))
    assert estimate_run_s(history, "small", "unpaged", 5, seq=8192) == pytest.approx(
        1.15 * (92 + 5 * 1.0 * 4**1.5))
    # Another size: the longest wall so far (at least the default).
    assert estimate_run_s(history, "expert_heavy", "paged", 12) == pytest.approx(
        1.15 * DEFAULT_RUN_S)
    assert fits(0.0, None, 1e9)
    assert fits(100.0, 300.0, 200.0) and not fits(100.0, 300.0, 200.1)


# ----------------------------------------------------------------------------- the driver

FAKE = r'''
import os, sys
BASE = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 "
        "--seq-length 2048 --max-position-embeddings 2048 --swiglu "
        "--untie-embeddings-and-output-weights --num-experts 16 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 1024 --moe-token-dispatcher-type flex "
        "--moe-expert-rank-capacity-factor 1.5 --micro-batch-size 1 --global-batch-size 8 "
        "--train-iters 20 --bf16 --vocab-size 32000").split()
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
mcore = flags.get("--paging-implementation") == ["mcore"]
act = 3000.0 - (200 if paged else 0) - (1500 if "moe" in mods else 0) - (
    300 if "core_attn" in mods else 0)
act *= seq / 2048
ms = (1200.0 if mcore else 1005.0 if paged else 1000.0) + (300 if "moe" in mods else 0)
ms *= seq / 2048
fb = 8000.0 + act
# The optimizer step's transient (2000) and a pool that lives through it set the step peak where
# the activations are small, as on the H200 (frontier_h200.json).
pool = 250.0 if paged else 0.0
steady = max(fb, 8000.0 + 2000.0 + pool)
fraction = os.environ.get("MEGATRON_PAGING_MEMORY_FRACTION")
for i in range(1, iters + 1):
    print(f" [t] iteration {i:8d}/{iters:8d} | elapsed time per iteration (ms): "
          f"{ms * (3 if i <= 3 else 1):.1f} | lm loss: 1.0E+01 | grad norm: 3.{i} |", flush=True)
    if fraction and steady > float(fraction) * 143771:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        sys.exit(1)
loss = 10.0 + (1e-6 if mods else 0.0)
with open(os.environ["MEGATRON_PAGING_LOSS_LOG"] + ".rank0", "w") as f:
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
    fake = tmp_path / "fake_example.py"
    fake.write_text(FAKE)
    script = tmp_path / "fake_run.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        exec "{sys.executable}" "{fake}" "$@"
        """))
    monkeypatch.setattr(frontier_arms, "SCRIPT", script)  # script_argv and Runner.run read it
    monkeypatch.setattr(bf, "_total_mib", lambda: 143771.0)
    return tmp_path


def test_driver_end_to_end_resume_and_time_budget(fake_example, capsys):
    out = fake_example / "res" / "frontier.json"
    common = ["--out", str(out), "--sizes", "small", "--arms", "unpaged,paged,recompute_moe",
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
    assert set(data["runs"]) == {"small:unpaged", "small:paged", "small:recompute_moe"}
    paged = data["runs"]["small:paged"]
    assert paged["status"] == "ok" and paged["timed_iterations"] == 2
    assert paged["step_ms"]["median"] == pytest.approx(1005.0)
    assert paged["activation_mib"] == pytest.approx(2800.0)
    assert paged["activation_source"] == "steady_fb_peak_allocated_mib"
    # recompute_moe's step peak is the optimizer's (10000); its activations are the fb peak's.
    rec = data["runs"]["small:recompute_moe"]
    assert rec["memory"]["steady_peak_allocated_mib"] == pytest.approx(10000.0)
    assert rec["activation_mib"] == pytest.approx(1500.0)
    assert paged["argv"][-3:] == ["--deterministic-mode", "--train-iters", "5"]
    assert "--moe-paged-stash" in paged["argv"] and paged["env"]["PAGED"] == "1"
    assert data["gpu"] is None or isinstance(data["gpu"], str)
    assert data["commit"] and data["date"] and len(data["calls"]) == 2
    summary = data["summary"]["small"]
    assert summary["paged"]["parity"]["bitwise_equal"] is True
    assert summary["recompute_moe"]["parity"]["bitwise_equal"] is False
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

    assert targets["paged_1.2x_faster_than_recompute_moe_at_le_its_activation"][
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
    assert all(r["env"]["MEGATRON_PAGING_MEMORY_FRACTION"] for r in budget_runs)
    assert "targets:" in printed and "left to run" not in printed.split("targets:")[0]
    # Report only: nothing runs, the table comes back from the file. The file may hold a removed
    # arm's run and splits written under the old definition (step peak - state).
    data = json.loads(out.read_text())
    old = dict(data["runs"]["small:recompute_moe"])
    old.update(key="small:paged_recompute_attn_norm", arm="paged_recompute_attn_norm",
               status="error", memory={}, activation_mib=None, step_ms=None)
    data["runs"][old["key"]] = old
    data["runs"]["small:recompute_moe"]["activation_mib"] = 2000.0  # stale: step-based
    data["runs"]["small:recompute_moe"].pop("activation_source")
    out.write_text(json.dumps(data))
    capsys.readouterr()
    assert bf.main(["--out", str(out), "--resume", "--report-only", "--sizes", "small",
                    "--arms", "unpaged,paged,recompute_moe", "--iters", "5", "--budget",
                    "no"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["calls"]) == 3  # report-only adds no call
    assert data["runs"]["small:recompute_moe"]["activation_mib"] == pytest.approx(1500.0)
    assert data["summary"]["small"]["recompute_moe"]["activation_mib"] == pytest.approx(1500.0)
    assert "paged_recompute_attn_norm" not in data["summary"]["small"]
    assert data["removed_arms"]["small:paged_recompute_attn_norm"]["status"] == "error"
    assert "removed arm, not reported: small:paged_recompute_attn_norm (error)" in printed
    assert "fb MiB" in printed and "rsv MiB" in printed and "left to run" not in printed


# ----------------------------------------------------------------------------- Megatron's parser


def test_every_runnable_arm_parses_with_megatron_and_our_flags():
    """Megatron's own argparse plus ours accepts every arm's full argument list, and our start-up
    validation accepts every paged combination."""
    pytest.importorskip("megatron.training")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_paging.mcore import flags

    parser = flags.add_paging_args(add_megatron_arguments(argparse.ArgumentParser(
        allow_abbrev=False)))
    offload = offload_available()
    for size in SIZES:
        for name, arm in ARMS.items():
            if skip_reason(arm, offload):
                continue
            argv = script_argv(frontier_extra(size, name), arm.paged)
            args = parser.parse_args(argv)
            flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
            assert args.deterministic_mode and args.moe_paged_stash == arm.paged, (size, name)
    # The removed arm's flags are refused at start-up without TE, not in the first forward.
    removed = script_argv([*SIZES["expert_heavy"].flags, "--recompute-granularity", "selective",
                           "--recompute-modules", "core_attn", "layernorm"], True)
    with pytest.raises(ValueError, match="--recompute-modules layernorm needs Transformer Eng"):
        flags.paging_config(parser.parse_args(removed), environ={}, cuda_available=False,
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
    for bad, words in (("small:recompute_moe", "--rerun: small:recompute_moe not among the arms"),
                       ("small-paged", "--rerun: 'small-paged' is not size:arm")):
        with pytest.raises(SystemExit, match=words):
            bf.main([*common, "--resume", "--rerun", bad])
    with pytest.raises(SystemExit, match="--only: 'tiny:paged' is not size:arm"):
        bf.main([*common, "--only", "tiny:paged"])


def test_env_option_reaches_every_run_and_its_record(fake_example):
    out = fake_example / "res" / "frontier_conn8.json"
    common = ["--out", str(out), "--sizes", "small", "--arms", "unpaged,paged", "--iters", "5",
              "--budget", "no"]
    assert bf.main([*common, "--env", "CUDA_DEVICE_MAX_CONNECTIONS=8"]) == 0
    data = json.loads(out.read_text())
    for key in ("small:unpaged", "small:paged"):
        run = data["runs"][key]
        assert run["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
        log = (out.parent / f"{run['log']}.log").read_text().splitlines()[0]
        assert log.startswith("# CUDA_DEVICE_MAX_CONNECTIONS=8 ")
    for bad, words in ((["--env", "CUDA_DEVICE_MAX_CONNECTIONS"], "expected NAME=VALUE"),
                       (["--env", "=8"], "expected NAME=VALUE"),
                       (["--env", "A=1", "--resume"], "--env with --resume")):
        with pytest.raises(SystemExit, match=words):
            bf.main([*common, *bad])
