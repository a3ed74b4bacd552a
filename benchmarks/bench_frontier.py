"""The memory-speed frontier of the Megatron example on one GPU: unpaged vs paged vs Megatron-Core's
own manager vs recomputing the MoE layer vs paged + selective recompute (and offloading, once the
offloading backend lands), at two model sizes, plus a fixed-memory-budget search.

Every arm is one run of ``examples/run_pretrain_1gpu.sh`` (Megatron's ``pretrain()`` on the
GPT-MoE of ``examples/pretrain_gpt_moe_paged.py``: local TE-free spec, fused SDPA attention,
``PagedGroupedMLP`` experts, static flex dispatcher, mock data) with the size's and the arm's flags
appended: same seeds, same static capacity (``--moe-expert-rank-capacity-factor``),
``--deterministic-mode``. Per arm it reports the median step time after warm-up (iterations 1-3
dropped) with its spread, the steady peak allocated memory (steps >= 3), the activation memory
(steady peak - parameters - gradients - optimizer state, all four printed by the example), the
bytes of live expert rows (computed from the flags, :func:`expert_bytes`), and bitwise parity of
every microbatch loss against the unpaged control (required for ``paged`` and ``mcore_manager``;
reported for the others). Under a memory cap (``MEGATRON_PAGING_MEMORY_FRACTION``) it searches the
longest sequence each budget arm trains and its tokens per second there.

One device call (at most 10 minutes) cannot hold the whole frontier, so the benchmark is
resumable: every finished run is appended to ``--out`` at once, ``--resume FILE`` carries the runs
of an earlier call over and skips them, ``--sizes`` / ``--arms`` / ``--only`` / ``--budget`` select,
and ``--time-budget-s`` stops cleanly before a run that the runs so far say cannot finish::

    python benchmarks/bench_frontier.py --out $OUT/frontier.json --time-budget-s 480 \
        [--resume benchmarks/results/frontier_h200.json] [--only expert_heavy:paged,...]
    python benchmarks/bench_frontier.py --dry-run            # the plan and every argv, no GPU
    python benchmarks/bench_frontier.py --resume F --out F --report-only   # re-render table/PNG

Writes JSON (GPU, date, commit per run and per call, every flag of every run) and a PNG beside it
(step time against activation memory, one point per arm per size; the budget search), and prints
a table and the targets (PASS / MISS / NOT RUN) last. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import default_out, figure, header, spread, write

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "run_pretrain_1gpu.sh"
# The offloading arms wait for this flag in the example's parser (the offloading backend issue).
FLAGS_SOURCE = ROOT / "megatron_paging" / "mcore" / "flags.py"
OFFLOAD_FLAG = "--paging-offload-backend"
MIB = 2**20
WARMUP_ITERS = 3  # dropped: 1 calibrates, 2 sizes the pools and Adam's state, 3 settles
FRONTIER_ITERS = 12  # -> 9 timed iterations per arm
BUDGET_ITERS = 5  # -> 2 timed iterations per budget candidate (enough for tokens/s)
DEFAULT_RUN_S = 150.0  # estimate for a run when nothing has run yet (start-up ~40-60 s + steps)
ESTIMATE_MARGIN = 1.15
RESERVE_FRACTION = 0.9  # budget prediction: the allocator's reserve/fragmentation headroom
# Diagnostics of the example that would distort timing or memory; never inherited by an arm.
DIAGNOSTIC_ENVS = (
    "MEGATRON_PAGING_PROFILE_ITER",
    "MEGATRON_PAGING_MEMORY_ITER",
    "MEGATRON_PAGING_KERNEL_COUNT_ITERS",
    "MEGATRON_PAGING_MEMORY_FRACTION",
)
COMMON_FLAGS = ("--deterministic-mode",)  # every arm, every run


# ---------------------------------------------------------------------------------------------
# arms and sizes


@dataclass(frozen=True)
class Arm:
    name: str
    paged: bool  # PAGED=1: the example script adds --moe-paged-stash and its pool flags
    flags: tuple[str, ...]
    exact: bool  # must reproduce the unpaged control bit for bit
    description: str
    needs_offload: bool = False  # waits for --paging-offload-backend in the example's parser


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("unpaged", False, (), False, "control: no paging, same static capacity"),
        Arm("paged", True, (), True, "--moe-paged-stash through megatron-paging"),
        Arm("mcore_manager", True, ("--paging-implementation", "mcore"), True,
            "--moe-paged-stash through Megatron-Core 0.19.2's own manager and Triton kernels"),
        Arm("recompute_moe", False,
            ("--recompute-granularity", "selective", "--recompute-modules", "moe"), False,
            "unpaged; recompute the whole MoE layer in backward"),
        Arm("paged_recompute_attn_norm", True,
            ("--recompute-granularity", "selective", "--recompute-modules", "core_attn",
             "layernorm"), False,
            "paged + selective recompute of core attention and the norms"),
        # Offloading (provisional flags: confirm them when the offloading backend lands).
        Arm("mcore_offload", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             "moe_act"), False,
            "Megatron-Core's fine-grained offloading of the expert modules (unpaged)", True),
        Arm("paged_offload", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             "moe_act", OFFLOAD_FLAG, "paged"), False,
            "our paged offloading backend for the expert modules (live rows only)", True),
        Arm("paged_stash_plus_offload", True,
            ("--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
             "qkv_linear", "core_attn", "attn_proj", "mlp_norm", OFFLOAD_FLAG, "paged"), False,
            "experts paged on the device, dense modules offloaded through our backend", True),
    )
}  # fmt: skip
# The control every other arm is compared with, and the arms that page (recompute target).
CONTROL = "unpaged"
PAGED_FAMILY = ("paged", "paged_recompute_attn_norm")


@dataclass(frozen=True)
class Size:
    name: str
    flags: tuple[str, ...]  # appended to the example script's defaults
    note: str


# Memory arithmetic (16 bytes per parameter: bf16 weight + bf16 grad buffer + fp32 master + two
# fp32 Adam moments; 1 GPU, so no sharding; :func:`estimate_memory` does the same sums):
#
# small (the example: 8 layers, hidden 1024, 16 experts top-2, moe-ffn 1024, seq 2048, vocab
#   32000): per layer 4h^2 = 4.2M attention + 16 x (1024 x 2048 + 1024 x 1024) = 50.3M experts;
#   x 8 + 2 x 32.8M embeddings = ~0.50B parameters -> ~8.0 GB of state. Expert activations per
#   layer: top-2 of 2048 tokens = 4096 live rows, 6144 capacity rows x (1024 + 2 x 1024) bf16 =
#   37.7 MB. Unfused attention peaked at 12.4 GiB (mcore_h200.json); SDPA needs less.
# expert_heavy (32 experts top-4, moe-ffn 2048, seq 4096): experts 32 x (1024 x 4096 + 2048 x
#   1024) = 201M per layer -> ~1.71B parameters -> ~27 GB of state. Expert activations per
#   layer: 16384 live rows, 24576 capacity rows x (1024 + 2 x 2048) bf16 = 252 MB, 2.0 GB over 8
#   layers (1.34 GB live) against ~0.7 GB of other per-layer activations and ~0.8 GB of logits
#   (4096 x 32000, bf16 + fp32): the experts dominate the activation memory. Peak ~31 GB of the
#   H200's 141 GB. Step: 32768 tokens x ~1.8 GFLOP/token (6 x 268M active parameters + causal
#   attention) = ~59 TFLOP, ~0.2 s of GPU time at 300 TFLOP/s; the example is host-bound (about
#   1 s per step at the small size), so 12 iterations take well under a minute after start-up.
# expert_heavy_cap2 (not run by default): expert_heavy with capacity factor 2.0, the headroom a
#   static capacity needs for EP imbalance; there paging's saving is 1 - 1.1/2 of the expert
#   activations instead of 1 - 1.1/1.5 (see docs/benchmarks.md).
SIZES: dict[str, Size] = {
    s.name: s
    for s in (
        Size("expert_heavy",
             ("--num-experts", "32", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "2048",
              "--seq-length", "4096", "--max-position-embeddings", "4096"),
             "expert activations dominate: 32 experts top-4, moe-ffn 2048, seq 4096"),
        Size("small", (), "examples/run_pretrain_1gpu.sh defaults: 16 experts top-2, seq 2048"),
        Size("expert_heavy_cap2",
             ("--num-experts", "32", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "2048",
              "--seq-length", "4096", "--max-position-embeddings", "4096",
              "--moe-expert-rank-capacity-factor", "2.0"),
             "expert_heavy with static capacity factor 2.0 (EP-imbalance headroom)"),
    )
}  # fmt: skip
DEFAULT_SIZES = ("expert_heavy", "small")
DEFAULT_BUDGET_ARMS = ("unpaged", "paged", "recompute_moe")


def offload_available(source: Path = FLAGS_SOURCE) -> bool:
    """Whether the example's parser has the offloading backend's flag (grep of its source)."""
    try:
        return OFFLOAD_FLAG in source.read_text()
    except OSError:
        return False


def skip_reason(arm: Arm, offload: bool) -> str | None:
    if arm.needs_offload and not offload:
        return (
            f"the example's parser has no {OFFLOAD_FLAG} "
            f"({FLAGS_SOURCE.relative_to(ROOT)}); the offloading backend lands separately"
        )
    return None


def frontier_extra(size: str, arm: str, iters: int = FRONTIER_ITERS) -> list[str]:
    """Flags appended to the example script for one frontier run (later flags win)."""
    return [*SIZES[size].flags, *ARMS[arm].flags, *COMMON_FLAGS, "--train-iters", str(iters)]


def budget_extra(size: str, arm: str, seq: int, iters: int = BUDGET_ITERS) -> list[str]:
    """Flags of one budget candidate: the size at sequence length ``seq``."""
    return [
        *SIZES[size].flags, *ARMS[arm].flags, *COMMON_FLAGS, "--train-iters", str(iters),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
    ]  # fmt: skip


def script_argv(extra: list[str], paged: bool, script: Path | None = None) -> list[str]:
    """Every argument the example script passes to the example (its ``DRY_RUN=1`` listing)."""
    script = SCRIPT if script is None else script
    env = {**os.environ, "DRY_RUN": "1", "PAGED": "1" if paged else "0",
           "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(script), *extra], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.splitlines()


def resolve_flags(argv: list[str]) -> dict[str, list[str]]:
    """``--flag value...`` -> {flag: values}; a repeated flag keeps its last values (argparse)."""
    flags: dict[str, list[str]] = {}
    key = None
    for token in argv:
        if token.startswith("--"):
            key = token
            flags[key] = []
        elif key is not None:
            flags[key].append(token)
    return flags


def model_config(argv: list[str]) -> dict:
    """The numbers of a run's model that the memory arithmetic needs, from its arguments."""
    f = resolve_flags(argv)

    def num(name, default=None, cast=int):
        values = f.get(name)
        return cast(values[0]) if values else default

    mbs = num("--micro-batch-size", 1)
    gbs = num("--global-batch-size", mbs)
    ffn = num("--ffn-hidden-size")
    return {
        "num_layers": num("--num-layers"),
        "hidden_size": num("--hidden-size"),
        "num_attention_heads": num("--num-attention-heads"),
        "num_query_groups": num("--num-query-groups"),
        "ffn_hidden_size": ffn,
        "moe_ffn_hidden_size": num("--moe-ffn-hidden-size", ffn),
        "num_experts": num("--num-experts"),
        "moe_router_topk": num("--moe-router-topk", 2),
        "capacity_factor": num("--moe-expert-rank-capacity-factor", None, float),
        "seq_length": num("--seq-length"),
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "microbatches": gbs // mbs,  # one GPU: data-parallel size 1
        "vocab_size": num("--vocab-size"),
        "swiglu": "--swiglu" in f,
        "untied_embeddings": "--untie-embeddings-and-output-weights" in f,
        "dtype_bytes": 2 if ("--bf16" in f or "--fp16" in f) else 4,
        "pipeline_parallel": num("--pipeline-model-parallel-size", 1),
        "expert_parallel": num("--expert-model-parallel-size", 1),
        "paged": "--moe-paged-stash" in f,
        "recompute_modules": f.get("--recompute-modules", []),
    }


def expert_bytes(cfg: dict) -> dict:
    """Bytes of the paged expert tensors in flight at a step's peak, from the flags.

    Routed rows per microbatch and layer = seq x micro_batch x topk (EP = 1: every routed row
    lands on this rank, none is dropped under a capacity factor >= 1). The paged tensors of a
    layer are ``PagedGroupedMLP``'s fc1 input (``hidden`` columns) and fc1 output (``2 x moe_ffn``
    with SwiGLU, else ``moe_ffn``), in the activation dtype. In flight: every layer of the stage
    times the microbatches in flight, which is 1 for Megatron's non-pipelined schedule (PP = 1:
    each microbatch's backward runs before the next forward) and ``min(pp, microbatches)`` on the
    first stage of 1F1B. Unpaged, each layer holds its capacity-sized buffers
    (``ceil(tokens x topk x factor)`` rows); paged, the pool holds the live rows (x the CUDA
    factor 1.10) and a layer's capacity-sized reload destinations exist during its backward.
    """
    if cfg["expert_parallel"] != 1:
        raise ValueError("expert_bytes assumes EP = 1 (the frontier runs on one GPU)")
    tokens = cfg["seq_length"] * cfg["micro_batch_size"]
    routed = tokens * cfg["moe_router_topk"]
    factor = cfg["capacity_factor"]
    capacity = math.ceil(routed * factor) if factor else routed
    ffn_cols = (2 if cfg["swiglu"] else 1) * cfg["moe_ffn_hidden_size"]
    row_bytes = (cfg["hidden_size"] + ffn_cols) * cfg["dtype_bytes"]
    pp = cfg["pipeline_parallel"]
    layers = cfg["num_layers"] // pp
    in_flight = 1 if pp == 1 else min(pp, cfg["microbatches"])
    live = routed * row_bytes * layers * in_flight
    one_layer = capacity * row_bytes
    return {
        "routed_rows_per_layer": routed,
        "capacity_rows_per_layer": capacity,
        "row_bytes": row_bytes,
        "layers_in_flight": layers,
        "microbatches_in_flight": in_flight,
        "live_expert_mib": live / MIB,
        "capacity_expert_mib": capacity * row_bytes * layers * in_flight / MIB,
        "one_layer_capacity_mib": one_layer / MIB,
        "paged_bound_mib": (1.1 * live + one_layer) / MIB,
    }


def estimate_memory(cfg: dict, non_expert_cols: int = 16) -> dict:
    """Sizing only (never reported as a measurement): parameters, 16 B/parameter of state, the
    expert capacity buffers and a generous estimate of every other activation
    (``non_expert_cols`` x hidden per token and layer, plus bf16 + 2 x fp32 logits)."""
    h, layers, experts = cfg["hidden_size"], cfg["num_layers"], cfg["num_experts"]
    ffn = cfg["moe_ffn_hidden_size"]
    heads = cfg["num_attention_heads"]
    groups = cfg["num_query_groups"] or heads
    attn = h * h + 2 * h * (h // heads) * groups + h * h  # q, k, v, output projection
    per_layer = attn + experts * (h * (2 if cfg["swiglu"] else 1) * ffn + ffn * h) + experts * h
    params = layers * per_layer + cfg["vocab_size"] * h * (2 if cfg["untied_embeddings"] else 1)
    tokens = cfg["seq_length"] * cfg["micro_batch_size"]
    dtype = cfg["dtype_bytes"]
    layers_other = tokens * layers * non_expert_cols * h * dtype
    logits = tokens * cfg["vocab_size"] * 10
    expert = expert_bytes(cfg)["capacity_expert_mib"] * MIB
    state = 16 * params
    return {"params": params, "state_bytes": state, "expert_capacity_bytes": expert,
            "non_expert_layers_bytes": layers_other, "logits_bytes": logits,
            "total_bytes": state + expert + layers_other + logits}


# ---------------------------------------------------------------------------------------------
# log parsing (the regexes of scripts/mcore_gpu_run.sh)

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"lm loss: ([-+.\dEe]+)")
GNORM = re.compile(r"grad norm: ([-+.\dEe]+|nan|inf)")
REPORT = re.compile(r"paging-example rank 0: (.*)")
OOM = re.compile(
    r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)


def parse_iterations(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        m = ITER.search(line)
        if m:
            loss, gnorm = LOSS.search(line), GNORM.search(line)
            rows.append({"iteration": int(m.group(1)), "ms": float(m.group(2)),
                         "lm_loss": loss.group(1) if loss else None,
                         "grad_norm": gnorm.group(1) if gnorm else None})
    return rows


def parse_report(text: str) -> dict:
    """The example's final ``paging-example rank 0: key=value ...`` line (numbers as floats)."""
    fields: dict = {}
    for m in REPORT.finditer(text):
        fields = {}
        for item in m.group(1).split():
            key, _, value = item.partition("=")
            try:
                fields[key] = float(value)
            except ValueError:
                fields[key] = value
    return fields


def read_losses(path: Path) -> list[str]:
    """The loss log's lines (``<loss float.hex> <tokens>``, one per microbatch)."""
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def classify(text: str, rc: int | None, timed_out: bool) -> str:
    """``ok`` (exit 0 and the final report), ``oom``, ``timeout`` or ``error``."""
    if timed_out:
        return "timeout"
    if rc == 0 and REPORT.search(text):
        return "ok"
    if OOM.search(text):
        return "oom"
    return "error"


def steady_step_ms(iterations: list[dict], warmup: int = WARMUP_ITERS) -> list[float]:
    return [r["ms"] for r in iterations if r["iteration"] > warmup]


def memory_split(report: dict) -> dict:
    """Activation memory = steady peak allocated - (parameters + gradients + optimizer state)."""
    keys = ("steady_peak_allocated_mib", "param_mib", "grad_mib", "optimizer_state_mib")
    if not all(isinstance(report.get(k), float) for k in keys):
        return {}
    state = report["param_mib"] + report["grad_mib"] + report["optimizer_state_mib"]
    return {"state_mib": state, "activation_mib": report["steady_peak_allocated_mib"] - state}


def spread_of(values: list[float]) -> dict | None:
    return spread(values) if values else None


def make_record(task: Task, argv: list[str], text: str, rc: int | None, timed_out: bool,
                wall_s: float, losses: list[str], meta: dict) -> dict:
    """One finished run as the JSON keeps it (everything computed from its log)."""
    status = classify(text, rc, timed_out)
    iterations = parse_iterations(text)
    report = parse_report(text)
    cfg = model_config(argv)
    step = spread_of(steady_step_ms(iterations))
    tokens = cfg["seq_length"] * cfg["global_batch_size"]
    record = {
        "key": task.key, "kind": task.kind, "size": task.size, "arm": task.arm,
        "seq": cfg["seq_length"], "train_iters": task.iters, "status": status, "rc": rc,
        "wall_s": round(wall_s, 1), "extra": list(task.extra), "argv": argv,
        "env": {"PAGED": "1" if task.paged else "0", **task.env}, "log": task.log_name,
        "iterations": iterations, "step_ms": step, "timed_iterations": len(steady_step_ms(
            iterations)),
        "memory": report, **memory_split(report), **expert_bytes(cfg),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / (step["median"] / 1e3) if step else None,
        "time_per_token_us": step["median"] * 1e3 / tokens if step else None,
        "microbatch_losses": losses, "grad_norms": [r["grad_norm"] for r in iterations],
        **meta,
    }
    if task.search is not None:
        record["search"] = task.search
        record["cap_gib"] = task.cap_gib
    if status != "ok":
        record["log_tail"] = text.splitlines()[-25:]
    return record


def parity(losses: list[str], control: list[str]) -> dict | None:
    """Every microbatch loss (and its token count) against the control's, exactly."""
    if not losses or not control:
        return None
    diffs = []
    for a, b in zip(losses, control, strict=False):
        x, y = float.fromhex(a.split()[0]), float.fromhex(b.split()[0])
        diffs.append(abs(x - y) / max(abs(y), 1e-30))
    return {"bitwise_equal": losses == control, "compared": min(len(losses), len(control)),
            "lengths": [len(losses), len(control)], "max_rel_loss_diff": max(diffs)}


# ---------------------------------------------------------------------------------------------
# summary and targets


def summarize(runs: dict) -> dict:
    """{size: {arm: row}} of the frontier runs, with parity against the size's control."""
    out: dict = {}
    for rec in runs.values():
        if rec["kind"] != "arm":
            continue
        control = runs.get(f"{rec['size']}:{CONTROL}")
        row = {k: rec.get(k) for k in (
            "status", "seq", "activation_mib", "state_mib", "live_expert_mib",
            "capacity_expert_mib", "one_layer_capacity_mib", "paged_bound_mib", "tokens_per_s",
            "commit")}  # fmt: skip
        mem = rec.get("memory", {})
        for k in ("steady_peak_allocated_mib", "peak_allocated_mib", "peak_reserved_mib",
                  "pool_cuda_mib", "overflow_actions", "paging_mode", "paged_steps"):
            row[k] = mem.get(k)
        # A paged arm whose engine never paged would be a second control: say so.
        row["paged_as_asked"] = (not ARMS[rec["arm"]].paged or bool(mem.get("paged_steps"))
                                 if rec["arm"] in ARMS else None)
        step = rec.get("step_ms")
        row["step_ms"] = step["median"] if step else None
        row["step_spread"] = step
        row["parity_required"] = ARMS[rec["arm"]].exact if rec["arm"] in ARMS else False
        if rec["arm"] != CONTROL and control and control.get("status") == "ok":
            row["parity"] = parity(rec.get("microbatch_losses", []),
                                   control.get("microbatch_losses", []))
            row["grad_norms_equal"] = (rec.get("grad_norms") == control.get("grad_norms")
                                       and bool(rec.get("grad_norms")))
        out.setdefault(rec["size"], {})[rec["arm"]] = row
    return out


def _ok(row: dict | None) -> bool:
    return bool(row) and row.get("status") == "ok" and row.get("step_ms") is not None


def _status(met: bool | None) -> str:
    return "NOT RUN" if met is None else ("PASS" if met else "MISS")


def _noise(a: dict, b: dict) -> float:
    """Combined relative half-range of two arms' step times."""
    return sum((r["step_spread"] or {}).get("relative_spread") or 0.0 for r in (a, b))


def ratio_target(rows: dict, num: str, den: str, limit: float) -> dict:
    a, b = rows.get(num), rows.get(den)
    if not (_ok(a) and _ok(b)):
        return {"status": "NOT RUN", "met": None}
    ratio = a["step_ms"] / b["step_ms"]
    noise = _noise(a, b)
    met = ratio <= limit
    return {"ratio": ratio, "limit": limit, "met": met, "status": _status(met),
            "combined_relative_spread": noise, "within_noise": abs(ratio - limit) <= noise}


def evaluate_targets(summary: dict, budget: dict | None = None,
                     target_size: str = "expert_heavy") -> dict:
    """The issue's targets from the measured numbers, per size (``target_size`` is where the
    recompute target is required) and for the budget search."""
    targets: dict = {}
    for size, rows in summary.items():
        t: dict = {}
        rec = rows.get("recompute_moe")
        per_arm = {}
        for name in PAGED_FAMILY:
            a = rows.get(name)
            if _ok(a) and _ok(rec) and a.get("activation_mib") is not None:
                speedup = rec["step_ms"] / a["step_ms"]
                mem_ok = a["activation_mib"] <= rec["activation_mib"]
                per_arm[name] = {"speedup_vs_recompute_moe": speedup,
                                 "activation_mib": a["activation_mib"],
                                 "recompute_activation_mib": rec["activation_mib"],
                                 "activation_le_recompute": mem_ok,
                                 "met": speedup >= 1.2 and mem_ok}
        met = any(v["met"] for v in per_arm.values()) if per_arm else None
        t["paged_1.2x_faster_than_recompute_moe_at_le_its_activation"] = {
            "per_arm": per_arm, "met": met, "status": _status(met),
            "required": size == target_size}
        paged, control = rows.get("paged"), rows.get(CONTROL)
        if _ok(paged) and paged.get("activation_mib") is not None:
            bound = paged["paged_bound_mib"]
            entry = {"live_expert_mib": paged["live_expert_mib"],
                     "one_layer_capacity_mib": paged["one_layer_capacity_mib"],
                     "bound_mib": bound, "activation_mib": paged["activation_mib"],
                     "pool_cuda_mib": paged.get("pool_cuda_mib"),
                     "met": paged["activation_mib"] <= bound}
            if _ok(control) and control.get("activation_mib") is not None:
                # Breakdown (derived): the control's activations minus its capacity-sized expert
                # buffers are the non-expert activations both runs share.
                other = control["activation_mib"] - control["capacity_expert_mib"]
                entry["non_expert_activation_mib"] = other
                entry["expert_activation_mib"] = paged["activation_mib"] - other
                entry["expert_share_met"] = entry["expert_activation_mib"] <= bound
            entry["status"] = _status(entry["met"])
        else:
            entry = {"status": "NOT RUN", "met": None}
        t["paged_activation_le_1.1x_live_plus_one_layer"] = entry
        t["paged_step_le_1.01x_unpaged"] = ratio_target(rows, "paged", CONTROL, 1.01)
        t["paged_step_le_0.9x_mcore_manager"] = ratio_target(rows, "paged", "mcore_manager", 0.9)
        exact = {}
        for name, row in rows.items():
            if name in ARMS and ARMS[name].exact:
                p = row.get("parity")
                exact[name] = p["bitwise_equal"] if p else None
        met = all(exact.values()) if exact and None not in exact.values() else None
        if exact and False in exact.values():
            met = False
        t["bitwise_parity_paged_and_mcore_manager"] = {"per_arm": exact, "met": met,
                                                       "status": _status(met)}
        targets[size] = t
    if budget:
        targets["budget"] = budget_target(budget)
    return targets


def budget_target(outcomes: dict) -> dict:
    """Paged trains a longer sequence than unpaged at <= 1.01x its time per token."""
    p, u = outcomes.get("paged"), outcomes.get(CONTROL)
    if not (p and u and p.get("max_seq") and u.get("max_seq")):
        return {"status": "NOT RUN", "met": None}
    longer = p["max_seq"] > u["max_seq"]
    ratio = p["time_per_token_us"] / u["time_per_token_us"]
    met = longer and ratio <= 1.01
    return {"paged_max_seq": p["max_seq"], "unpaged_max_seq": u["max_seq"], "longer": longer,
            "time_per_token_ratio": ratio, "met": met, "status": _status(met),
            "concluded": bool(p.get("concluded") and u.get("concluded"))}


# ---------------------------------------------------------------------------------------------
# the budget search


def _floor_to(x: float, unit: int) -> int:
    return int(x // unit) * unit


def _ceil_to(x: float, unit: int) -> int:
    return int(math.ceil(x / unit)) * unit


def next_candidate(tried: dict[int, bool], start: int, step_ratio: float, resolution: int,
                   unit: int, max_runs: int, max_seq: int) -> int | None:
    """The next sequence length to try, or None when the search is over.

    ``tried`` maps a length to whether it trained. Up by ``1 + step_ratio`` while everything
    fits (doubling for 1.0), down by the same factor while nothing fits, then bisect between the
    longest fit below the shortest failure and that failure until they are ``resolution`` apart;
    at most ``max_runs`` candidates, lengths multiples of ``unit``, none above ``max_seq``.
    """
    if not tried:
        return min(max(_floor_to(start, unit), unit), max_seq)
    if len(tried) >= max_runs:
        return None
    oks = sorted(s for s, fit in tried.items() if fit)
    bads = sorted(s for s, fit in tried.items() if not fit)
    if not bads:
        nxt = min(max_seq, _ceil_to(oks[-1] * (1 + step_ratio), unit))
        return nxt if nxt > oks[-1] and nxt not in tried else None
    hi = bads[0]
    below = [s for s in oks if s < hi]
    if not below:
        nxt = _floor_to(hi / (1 + step_ratio), unit)
        return nxt if unit <= nxt < hi and nxt not in tried else None
    lo = below[-1]
    if hi - lo <= resolution:
        return None
    mid = _floor_to((lo + hi) / 2, unit)
    return mid if lo < mid < hi and mid not in tried else None


def predict_start(frontier: dict | None, cap_mib: float, base_seq: int, unit: int,
                  max_seq: int) -> dict:
    """Where an arm's search starts: predicted from its frontier run at the budget size
    (activation memory grows linearly with the sequence under SDPA attention; state is fixed),
    with a 12.5% step; without one, at the size's own length, doubling."""
    if (frontier and frontier.get("status") == "ok" and frontier.get("activation_mib")
            and frontier["activation_mib"] > 0 and frontier.get("seq")):
        usable = cap_mib * RESERVE_FRACTION - frontier["state_mib"]
        predicted = frontier["seq"] * usable / frontier["activation_mib"]
        start = min(max(_floor_to(predicted, unit), unit), max_seq)
        return {"start": start, "step_ratio": 0.125, "predicted_seq": predicted,
                "predicted_from": frontier["key"]}
    return {"start": base_seq, "step_ratio": 1.0, "predicted_seq": None, "predicted_from": None}


def budget_records(runs: dict, size: str, arm: str, cap_gib: float, iters: int) -> list[dict]:
    return [r for r in runs.values() if r["kind"] == "budget" and r["size"] == size
            and r["arm"] == arm and r.get("cap_gib") == cap_gib and r["train_iters"] == iters]


def budget_outcome(records: list[dict], opts: BudgetOptions) -> dict:
    """The longest length that trained, its speed, and whether the search is over."""
    tried = {r["seq"]: r["status"] == "ok" for r in records if r["status"] in ("ok", "oom")}
    errors = [r["seq"] for r in records if r["status"] not in ("ok", "oom")]
    search = records[0]["search"] if records else None
    oks = [r for r in records if r["status"] == "ok" and r.get("step_ms")]
    best = max(oks, key=lambda r: r["seq"]) if oks else None
    concluded = bool(errors) or (search is not None and next_candidate(
        tried, search["start"], search["step_ratio"], opts.resolution, opts.unit,
        opts.max_runs, opts.max_seq) is None)
    fails = sorted(s for s, fit in tried.items() if not fit and (not best or s > best["seq"]))
    return {
        "candidates": {str(r["seq"]): r["status"] for r in sorted(records, key=lambda r: r["seq"])},
        "max_seq": best["seq"] if best else None,
        "first_failure_above": fails[0] if fails else None,
        "tokens_per_s": best["tokens_per_s"] if best else None,
        "time_per_token_us": best["time_per_token_us"] if best else None,
        "step_ms": best["step_ms"]["median"] if best else None,
        "steady_peak_allocated_mib": best["memory"].get("steady_peak_allocated_mib")
        if best else None,
        "activation_mib": best.get("activation_mib") if best else None,
        "errors": errors, "search": search, "concluded": concluded,
    }


# ---------------------------------------------------------------------------------------------
# selection, resume, time budget


@dataclass
class Task:
    kind: str  # "arm" (frontier) or "budget"
    size: str
    arm: str
    extra: tuple[str, ...]
    iters: int
    seq: int | None = None
    env: dict = field(default_factory=dict)
    search: dict | None = None
    cap_gib: float | None = None

    @property
    def paged(self) -> bool:
        return ARMS[self.arm].paged

    @property
    def key(self) -> str:
        if self.kind == "arm":
            return f"{self.size}:{self.arm}"
        return f"budget:{self.size}:{self.arm}:{self.seq}:{self.cap_gib:g}GiB"

    @property
    def log_name(self) -> str:
        if self.kind == "arm":
            return f"frontier_{self.size}_{self.arm}"
        return f"frontier_budget_{self.size}_{self.arm}_s{self.seq}"


@dataclass(frozen=True)
class BudgetOptions:
    size: str = "expert_heavy"
    arms: tuple[str, ...] = DEFAULT_BUDGET_ARMS
    cap_gib: float = 36.0
    iters: int = BUDGET_ITERS
    max_runs: int = 5
    resolution: int = 512
    unit: int = 512
    max_seq: int = 65536


def parse_only(only: str | None) -> list[tuple[str, str]] | None:
    if not only:
        return None
    pairs = []
    for item in only.split(","):
        size, sep, arm = item.strip().partition(":")
        if not sep or size not in SIZES or arm not in ARMS:
            raise ValueError(f"--only: {item!r} is not size:arm (sizes {sorted(SIZES)}, "
                             f"arms {sorted(ARMS)})")
        pairs.append((size, arm))
    return pairs


def is_done(record: dict | None, task: Task, retry_failed: bool) -> bool:
    """A run counts as done when the file has it with the same flags (and, unless
    ``retry_failed``, whatever its outcome)."""
    if not record or record.get("extra") != list(task.extra):
        return False
    return record.get("status") == "ok" or not retry_failed


def frontier_tasks(sizes: list[str], arms: list[str], only: list[tuple[str, str]] | None,
                   runs: dict, iters: int, offload: bool, retry_failed: bool = False):
    """(tasks still to run, {key: skip reason}); the control first in every size."""
    pairs = only if only is not None else [(s, a) for s in sizes for a in arms]
    tasks, skipped = [], {}
    for size, arm in pairs:
        task = Task("arm", size, arm, tuple(frontier_extra(size, arm, iters)), iters)
        reason = skip_reason(ARMS[arm], offload)
        if reason:
            skipped[task.key] = reason
        elif not is_done(runs.get(task.key), task, retry_failed):
            tasks.append(task)
    order = list(ARMS)
    tasks.sort(key=lambda t: (pairs.index((t.size, t.arm)) if only else
                              (sizes.index(t.size), order.index(t.arm))))
    return tasks, skipped


def estimate_run_s(history: list[dict], size: str, arm: str, iters: int, seq: int | None = None,
                   default_s: float = DEFAULT_RUN_S, margin: float = ESTIMATE_MARGIN) -> float:
    """Seconds a run will take, from the runs so far: start-up (wall - iterations x step time,
    the worst seen at this size) + ``iters`` x the step time (this arm's, else the size's worst;
    scaled by (seq / its seq)^1.5 for a longer sequence), x ``margin``."""
    timed = [r for r in history if r.get("size") == size and r.get("wall_s") and r.get("step_ms")]
    if not timed:
        walls = [r["wall_s"] for r in history if r.get("wall_s")]
        return margin * max([default_s, *walls])

    def step_s(r):
        s = r["step_ms"]["median"] / 1e3
        if seq and r.get("seq"):
            s *= max(1.0, seq / r["seq"]) ** 1.5
        return s

    startup = max(0.0, max(r["wall_s"] - r["train_iters"] * r["step_ms"]["median"] / 1e3
                           for r in timed))
    same_arm = [r for r in timed if r.get("arm") == arm] or timed
    return margin * (startup + iters * max(step_s(r) for r in same_arm))


def fits(now: float, deadline: float | None, estimate_s: float) -> bool:
    """Whether a run estimated at ``estimate_s`` can finish before ``deadline``."""
    return deadline is None or now + estimate_s <= deadline


def load_runs(path: Path | None) -> tuple[dict, list]:
    """(runs, calls) of an earlier call's file (empty when there is none)."""
    if path is None or not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    if data.get("benchmark") != "frontier":
        raise ValueError(f"{path} is not a frontier result (benchmark={data.get('benchmark')!r})")
    return dict(data.get("runs", {})), list(data.get("calls", []))


def provenance(runs: dict, current: dict) -> dict:
    """Top-level gpu/date/commit: those of the measured runs (all of them, when mixed)."""
    gpus = sorted({r.get("gpu") for r in runs.values() if r.get("gpu")})
    commits = sorted({r.get("commit") for r in runs.values() if r.get("commit")})
    dates = sorted(r.get("date") for r in runs.values() if r.get("date"))
    return {
        "gpu": ", ".join(gpus) if gpus else current.get("gpu"),
        "commit": ", ".join(commits) if commits else current.get("commit"),
        "date": dates[-1] if dates else current.get("date"),
        "mixed_commits": len(commits) > 1,
    }


def remaining(tasks: list[Task], runs: dict, budget: dict, opts: BudgetOptions | None) -> list:
    """What the selection still lacks: frontier runs not recorded (or failed), budget searches
    not concluded."""
    left = []
    for t in tasks:
        record = runs.get(t.key)
        if not record or record.get("extra") != list(t.extra):
            left.append(t.key)
        elif record.get("status") != "ok":
            left.append(f"{t.key} ({record.get('status')}; --retry-failed runs it again)")
    if opts is not None:
        for arm in opts.arms:
            out = budget.get(arm)
            if not out or not out["concluded"]:
                left.append(f"budget:{opts.size}:{arm} (search not concluded)")
    return left


# ---------------------------------------------------------------------------------------------
# running the example


class Runner:
    def __init__(self, log_dir: Path, run_timeout_s: float, meta: dict):
        self.log_dir, self.run_timeout_s, self.meta = log_dir, run_timeout_s, meta
        log_dir.mkdir(parents=True, exist_ok=True)

    def run(self, task: Task, timeout_s: float) -> tuple[dict | None, bool]:
        """Run one task; (record, cut): ``cut`` when the time budget (not the run limit) ended
        it, in which case nothing is recorded."""
        argv = script_argv(list(task.extra), task.paged)
        log = self.log_dir / f"{task.log_name}.log"
        loss_log = self.log_dir / f"{task.log_name}_loss"
        for stale in self.log_dir.glob(f"{loss_log.name}.rank*"):
            stale.unlink()
        env = {k: v for k, v in os.environ.items() if k not in DIAGNOSTIC_ENVS}
        env.update({"PAGED": "1" if task.paged else "0", "NPROC": "1", "PYTHON": sys.executable,
                    "MEGATRON_PAGING_LOSS_LOG": str(loss_log), "NCCL_NVLS_ENABLE": "0",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **task.env})
        limit = min(self.run_timeout_s, timeout_s)
        t0 = time.monotonic()
        timed_out = False
        with log.open("w") as out:
            out.write("# " + " ".join([f"{k}={v}" for k, v in task.env.items()] +
                                      [f"PAGED={env['PAGED']}", "bash", str(SCRIPT),
                                       *task.extra]) + "\n")
            out.flush()
            proc = subprocess.Popen(["bash", str(SCRIPT), *task.extra], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                _stop_group(proc)
                rc = proc.returncode
            finally:  # SIGTERM of this process (a step's time limit) or an exception
                if proc.poll() is None:
                    _stop_group(proc)
        wall = time.monotonic() - t0
        if timed_out and limit < self.run_timeout_s:
            return None, True  # cut by the time budget: not a result
        text = log.read_text(errors="replace")
        losses = read_losses(Path(f"{loss_log}.rank0"))
        return make_record(task, argv, text, rc, timed_out, wall, losses, self.meta), False


def _stop_group(proc: subprocess.Popen) -> None:
    """End the run's own process group (the script, torchrun and its worker)."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------------------------
# output


def build_result(current: dict, settings: dict, runs: dict, calls: list, skipped: dict,
                 offload: bool, budget: dict | None, opts: BudgetOptions | None,
                 left: list) -> dict:
    summary = summarize(runs)
    sizes = {}
    for name, size in SIZES.items():
        entry = {"flags": list(size.flags), "note": size.note}
        example = next((r for r in runs.values() if r["kind"] == "arm" and r["size"] == name),
                       None)
        if example:
            entry["config"] = model_config(example["argv"])
            entry["expert_bytes"] = expert_bytes(entry["config"])
        sizes[name] = entry
    arms = {
        name: {"flags": list(a.flags), "paged": a.paged, "exact": a.exact,
               "description": a.description, "needs_offload": a.needs_offload,
               "skip_reason": skip_reason(a, offload)}
        for name, a in ARMS.items()
    }
    result = {
        "benchmark": "frontier",
        **provenance(runs, current),
        "this_call": current,
        "settings": settings,
        "common_flags": list(COMMON_FLAGS),
        "method": (
            "each run = examples/run_pretrain_1gpu.sh + the size's and the arm's flags; "
            f"step time = median of iterations > {WARMUP_ITERS} (Megatron's 'elapsed time per "
            "iteration'), spread = common.spread; activation = steady_peak_allocated_mib - "
            "(param_mib + grad_mib + optimizer_state_mib) as the example prints them; live "
            "expert bytes computed from the flags (bench_frontier.expert_bytes); parity = every "
            "microbatch loss (float.hex) equal to the unpaged run of the same size"),
        "sizes": sizes,
        "arms": arms,
        "skipped": skipped,
        "summary": summary,
        "budget": {"options": asdict(opts) if opts else None, "outcomes": budget or {}},
        "targets": evaluate_targets(summary, budget),
        "remaining": left,
        "calls": calls,
        "runs": runs,
    }
    return result


def save(result: dict, out: Path) -> None:
    """The JSON, written atomically (a run killed mid-write leaves the previous file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(result: dict) -> list[str]:
    lines = [f"frontier: {result.get('gpu') or 'no GPU'}, commit {result.get('commit')}"]
    head = (f"{'size':<18} {'arm':<26} {'status':<7} {'step ms':>8} {'spread':>7} "
            f"{'peak MiB':>9} {'act MiB':>9} {'live MiB':>9} {'bitwise':>8}")
    lines += [head, "-" * len(head)]
    for size, rows in result["summary"].items():
        for arm in ARMS:
            row = rows.get(arm)
            if row is None:
                continue
            spread = (row.get("step_spread") or {}).get("relative_spread")
            par = row.get("parity")
            status = row["status"] if row.get("paged_as_asked") is not False else "nopage"
            lines.append(
                f"{size:<18} {arm:<26} {status:<7} {_fmt(row['step_ms']):>8} "
                f"{_fmt(spread * 100 if spread is not None else None, '.1f') + '%':>7} "
                f"{_fmt(row.get('steady_peak_allocated_mib')):>9} "
                f"{_fmt(row.get('activation_mib')):>9} {_fmt(row.get('live_expert_mib')):>9} "
                f"{'-' if par is None else ('yes' if par['bitwise_equal'] else 'NO'):>8}")
    outcomes = result["budget"]["outcomes"]
    if outcomes:
        opts = result["budget"]["options"]
        lines.append(f"budget: {opts['size']} under {opts['cap_gib']:g} GiB "
                     f"(MEGATRON_PAGING_MEMORY_FRACTION), {opts['iters']} iterations per run")
        for arm, o in outcomes.items():
            lines.append(
                f"  {arm:<26} max seq {_fmt(o['max_seq'], 'd'):>6}  tokens/s "
                f"{_fmt(o['tokens_per_s'], '.0f'):>8}  "
                f"us/token {_fmt(o['time_per_token_us'], '.2f')}"
                f"  tried {o['candidates']}{'' if o['concluded'] else '  (not concluded)'}")
    lines.append("targets:")
    for scope, targets in result["targets"].items():
        if scope == "budget":
            lines.append(f"  budget: paged longer than unpaged at <= 1.01x time/token: "
                         f"{targets['status']}"
                         + (f" (paged {targets['paged_max_seq']} vs unpaged "
                            f"{targets['unpaged_max_seq']}, time/token ratio "
                            f"{targets['time_per_token_ratio']:.3f})"
                            if targets.get("met") is not None else ""))
            continue
        for name, t in targets.items():
            detail = ""
            if "ratio" in t:
                detail = f" (ratio {t['ratio']:.3f}" + (", within noise)" if t["within_noise"]
                                                         else ")")
            elif name.startswith("paged_activation") and t.get("met") is not None:
                detail = (f" (activation {t['activation_mib']:.0f} MiB vs bound "
                          f"{t['bound_mib']:.0f} MiB"
                          + (f"; expert share {t['expert_activation_mib']:.0f} MiB: "
                             f"{_status(t['expert_share_met'])}" if "expert_share_met" in t
                             else "") + ")")
            elif name.startswith("paged_1.2x"):
                detail = "".join(
                    f" [{a}: {v['speedup_vs_recompute_moe']:.2f}x, act "
                    f"{v['activation_mib']:.0f} vs {v['recompute_activation_mib']:.0f} MiB]"
                    for a, v in t["per_arm"].items())
                if t.get("required"):
                    detail += " (required at this size)"
            lines.append(f"  {scope}: {name}: {t['status']}{detail}")
    if result["skipped"]:
        lines.append("skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items()))
    if result["remaining"]:
        lines.append("left to run: " + ", ".join(result["remaining"]))
    return lines


def plot(result: dict):
    def draw(png: Path) -> None:
        sizes = [s for s, rows in result["summary"].items()
                 if any(_ok(r) and r.get("activation_mib") is not None for r in rows.values())]
        outcomes = result["budget"]["outcomes"]
        panels = len(sizes) + (1 if outcomes else 0)
        if panels == 0:
            return
        fig = figure(5.2 * panels, 4.6)
        colors = dict(zip(ARMS, ("grey", "tab:blue", "tab:orange", "tab:red", "tab:cyan",
                                 "tab:brown", "tab:purple", "tab:green"), strict=True))
        for i, size in enumerate(sizes):
            ax = fig.add_subplot(1, panels, i + 1)
            for arm, row in result["summary"][size].items():
                if not _ok(row) or row.get("activation_mib") is None:
                    continue
                s = row["step_spread"]
                ax.errorbar([row["activation_mib"] / 1024], [s["median"]],
                            yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                            fmt="o", color=colors.get(arm, "k"), capsize=3, label=arm)
            live = next((r.get("live_expert_mib") for r in result["summary"][size].values()
                         if r.get("live_expert_mib")), None)
            ax.set_xlabel("activation memory (GiB): steady peak - params - grads - optimizer")
            ax.set_ylabel("median step time (ms), bars: min-max")
            ax.set_title(f"{size}" + (f" (live expert rows {live / 1024:.2f} GiB)"
                                      if live else ""), fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        if outcomes:
            ax = fig.add_subplot(1, panels, panels)
            names = list(outcomes)
            seqs = [outcomes[n]["max_seq"] or 0 for n in names]
            ax.bar(names, seqs, color=[colors.get(n, "k") for n in names])
            for j, n in enumerate(names):
                tps = outcomes[n]["tokens_per_s"]
                ax.text(j, seqs[j], f"{tps:.0f} tok/s" if tps else "none fit", ha="center",
                        va="bottom", fontsize=7)
            opts = result["budget"]["options"]
            ax.set_ylabel("longest sequence trained")
            ax.set_title(f"{opts['size']} under {opts['cap_gib']:g} GiB", fontsize=9)
            ax.tick_params(axis="x", labelsize=7, rotation=15)
        fig.suptitle(f"Megatron GPT-MoE frontier, {result.get('gpu') or 'no GPU'}, "
                     f"{str(result.get('commit'))[:8]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(png)

    return draw


# ---------------------------------------------------------------------------------------------
# main


def _csv(value: str | None, choices, what: str) -> list[str]:
    items = [v.strip() for v in (value or "").split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if bad:
        raise SystemExit(f"error: unknown {what} {bad}; choose from {sorted(choices)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (PNG and, by default, logs beside it)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="FILE",
                        help="carry over the runs of FILE (default: --out) and skip them")
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                        help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {list(ARMS)}")
    parser.add_argument("--only", default=None, help="size:arm,... (instead of sizes x arms)")
    parser.add_argument("--budget", choices=("yes", "no", "only"), default="yes",
                        help="the fixed-budget search after the frontier runs, not, or only it")
    parser.add_argument("--budget-size", default="expert_heavy", choices=sorted(SIZES))
    parser.add_argument("--budget-arms", default=",".join(DEFAULT_BUDGET_ARMS))
    parser.add_argument("--budget-gib", type=float, default=36.0,
                        help="memory cap in GiB (MEGATRON_PAGING_MEMORY_FRACTION = cap / total)")
    parser.add_argument("--budget-iters", type=int, default=BUDGET_ITERS)
    parser.add_argument("--budget-max-runs", type=int, default=5, help="candidates per arm")
    parser.add_argument("--budget-resolution", type=int, default=512,
                        help="stop bisecting when fit and failure are this many tokens apart")
    parser.add_argument("--budget-unit", type=int, default=512, help="lengths are multiples")
    parser.add_argument("--budget-max-seq", type=int, default=65536)
    parser.add_argument("--iters", type=int, default=FRONTIER_ITERS,
                        help=f"iterations per frontier run (the first {WARMUP_ITERS} untimed)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop before a run that cannot finish within this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=420.0)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="run logs (default: --out's folder when given, else out/)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run again what the resumed file has as failed (not OOM candidates)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: rebuild summary, targets, table and PNG from --resume")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.time_budget_s if args.time_budget_s else None

    out = args.out or default_out("frontier")
    resume = None if args.resume is None else Path(args.resume or out)
    runs, calls = load_runs(resume)
    if resume is not None and not resume.exists():
        print(f"frontier: {resume} does not exist yet; starting empty", flush=True)
    sizes = _csv(args.sizes, SIZES, "sizes")
    arms = _csv(args.arms, ARMS, "arms")
    only = parse_only(args.only)
    budget_arms = tuple(_csv(args.budget_arms, ARMS, "budget arms"))
    opts = None if args.budget == "no" else BudgetOptions(
        args.budget_size, budget_arms, args.budget_gib, args.budget_iters, args.budget_max_runs,
        args.budget_resolution, args.budget_unit, args.budget_max_seq)
    offload = offload_available()
    current = header("frontier")
    current["argv"] = sys.argv[1:] if argv is None else argv
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    tasks, skipped = frontier_tasks(sizes, arms, only, runs, args.iters, offload,
                                    args.retry_failed)
    if args.budget == "only":
        tasks = []
    for key, reason in skipped.items():
        print(f"frontier: skip {key}: {reason}", flush=True)
    # Logs beside an explicit --out ($OUT on the device: gpu_check archives *.log there), else in
    # the ignored out/ folder rather than benchmarks/results/.
    log_dir = args.log_dir or (out.parent if args.out else ROOT / "out")
    total_mib = _total_mib() if opts and not args.report_only and not args.dry_run else None

    if args.dry_run:
        for i, task in enumerate(tasks, 1):
            argv_ = script_argv(list(task.extra), task.paged)  # the script accepts the flags
            print(f"frontier: plan [{i}/{len(tasks)}] {task.key}: PAGED={int(task.paged)} bash "
                  f"{_rel(SCRIPT)} {' '.join(task.extra)} ({len(argv_)} arguments)",
                  flush=True)
        if opts:
            print(f"frontier: plan budget {opts.size} under {opts.cap_gib:g} GiB for "
                  f"{', '.join(opts.arms)}: up to {opts.max_runs} runs each", flush=True)
        return 0

    this_call = {**current, "ran": [], "stopped": None}
    if not args.report_only:
        calls = [*calls, this_call]
    ran_failed = False

    def outcomes() -> dict:
        if opts is None:
            return {}
        return {arm: budget_outcome(budget_records(runs, opts.size, arm, opts.cap_gib,
                                                   opts.iters), opts) for arm in opts.arms}

    def result() -> dict:
        b = outcomes()
        return build_result(current, settings, runs, calls, skipped, offload, b, opts,
                            remaining(all_tasks, runs, b, opts))

    # What is left is measured against the whole selection, not only this call's runs.
    all_tasks = frontier_tasks(sizes, arms, only, {}, args.iters, offload)[0]
    runner = None if args.report_only else Runner(log_dir, args.run_timeout_s, {
        "gpu": current["gpu"], "commit": current["commit"]})

    def stop(reason: str) -> None:
        this_call["stopped"] = reason
        print(f"frontier: stopping: {reason}", flush=True)

    def execute(task: Task, label: str) -> dict | None:
        nonlocal ran_failed
        history = list(runs.values())
        estimate = estimate_run_s(history, task.size, task.arm, task.iters, task.seq)
        now = time.monotonic()
        if not fits(now, deadline, estimate):
            stop(f"time budget: {task.key} needs ~{estimate:.0f} s, "
                 f"{deadline - now:.0f} s left")
            return None
        print(f"frontier: start {task.key} (estimate {estimate:.0f} s"
              + (f", {deadline - now:.0f} s left" if deadline else "") + ")", flush=True)
        timeout = (deadline - now) if deadline else args.run_timeout_s
        record, cut = runner.run(task, timeout)
        if cut:
            stop(f"time budget: {task.key} was cut at the deadline (not recorded)")
            return None
        record["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        runs[task.key] = record
        this_call["ran"].append(task.key)
        if record["status"] != "ok" and not (task.kind == "budget" and record["status"] == "oom"):
            ran_failed = True
        save(result(), out)
        step = record["step_ms"]["median"] if record["step_ms"] else None
        print(f"frontier: size={task.size} arm={task.arm}"
              + (f" seq={task.seq}" if task.kind == "budget" else "")
              + f" status={record['status']} step_ms={_fmt(step)}"
              f" act_mib={_fmt(record.get('activation_mib'))}"
              f" peak_mib={_fmt(record['memory'].get('steady_peak_allocated_mib'))}"
              f" wall_s={record['wall_s']} {label}", flush=True)
        return record

    if not args.report_only:
        for i, task in enumerate(tasks, 1):
            if execute(task, f"[{i}/{len(tasks)}]") is None:
                break
        else:
            if opts is not None:
                run_budget(opts, runs, total_mib, execute, args.retry_failed)
    b = outcomes()
    final = build_result(current, settings, runs, calls, skipped, offload, b, opts,
                         remaining(all_tasks, runs, b, opts))
    try:
        write(final, out, plot(final))
    except Exception as error:  # noqa: BLE001 - the JSON is written before the PNG
        print(f"frontier: PNG not written: {error!r}", flush=True)
    for line in table(final):
        print(line, flush=True)
    return 1 if ran_failed else 0


def next_budget_task(opts: BudgetOptions, runs: dict, arm: str, fraction: float,
                     base_seq: int) -> Task | None:
    """The arm's next budget candidate as a task, or None when its search is over (concluded,
    or stopped by a candidate that failed other than by running out of memory)."""
    records = budget_records(runs, opts.size, arm, opts.cap_gib, opts.iters)
    if any(r["status"] not in ("ok", "oom") for r in records):
        return None  # an error is not a memory limit: the search stops and says so
    search = records[0]["search"] if records else predict_start(
        runs.get(f"{opts.size}:{arm}"), opts.cap_gib * 1024, base_seq, opts.unit, opts.max_seq)
    tried = {r["seq"]: r["status"] == "ok" for r in records}
    seq = next_candidate(tried, search["start"], search["step_ratio"], opts.resolution,
                         opts.unit, opts.max_runs, opts.max_seq)
    if seq is None:
        return None
    return Task("budget", opts.size, arm, tuple(budget_extra(opts.size, arm, seq, opts.iters)),
                opts.iters, seq, {"MEGATRON_PAGING_MEMORY_FRACTION": f"{fraction:.6f}"},
                search, opts.cap_gib)


def run_budget(opts: BudgetOptions, runs: dict, total_mib: float, execute,
               retry_failed: bool = False, base_seq: int | None = None,
               offload: bool | None = None) -> bool:
    """The fixed-budget search, arm after arm, each candidate one ``execute(task, label)`` under
    the cap (``execute`` records it in ``runs`` and returns None to stop: the time budget).
    With ``retry_failed`` the candidates that errored earlier (not an OOM) are dropped first, so
    the search runs past them again. Returns False when stopped early."""
    fraction = opts.cap_gib * 1024 / total_mib
    if not 0 < fraction < 1:
        raise SystemExit(f"error: --budget-gib {opts.cap_gib} is not below the device's "
                         f"{total_mib / 1024:.1f} GiB")
    if base_seq is None:
        base_seq = model_config(script_argv(list(SIZES[opts.size].flags), False))["seq_length"]
    offload = offload_available() if offload is None else offload
    if retry_failed:
        for key in [k for k, r in runs.items()
                    if r["kind"] == "budget" and r["status"] not in ("ok", "oom")]:
            del runs[key]
    for arm in opts.arms:
        reason = skip_reason(ARMS[arm], offload)
        if reason:
            print(f"frontier: skip budget {arm}: {reason}", flush=True)
            continue
        while (task := next_budget_task(opts, runs, arm, fraction, base_seq)) is not None:
            count = len(budget_records(runs, opts.size, arm, opts.cap_gib, opts.iters))
            if execute(task, f"[budget {arm} run {count + 1}/{opts.max_runs}]") is None:
                return False
            if task.key not in runs:  # nothing recorded: the same task again would loop
                print(f"frontier: budget {task.key} left no record; stopping the search",
                      flush=True)
                return False
    return True


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _total_mib() -> float:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: the budget search needs a CUDA device (use --budget no)")
    return torch.cuda.get_device_properties(0).total_memory / MIB


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through Runner.run, which ends the running example


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(main())
