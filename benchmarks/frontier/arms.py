"""The frontier's arms and model sizes, the flags and environment each run adds to the example
script, and the memory arithmetic computed from a run's flags (live expert bytes, sizing). Arms
are named as benchmarks/arm_names.py says: the plan's arm, then the variant."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from arm_names import arm_name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_pretrain_1gpu.sh"
OFFLOAD = ("--fine-grained-activation-offloading", "--offload-modules")
OFFLOAD_BACKEND = "--paging-offload-backend"
RECOMPUTE_FC1 = "--paging-recompute-expert-fc1"
CUDA_FACTOR = "--moe-paged-stash-buffer-size-factor-cuda"  # Megatron-Core's pool flags
CPU_FACTOR = "--moe-paged-stash-buffer-size-factor-cpu"
UNFUSED = "--no-bias-swiglu-fusion"  # the example fuses the experts' weighted SwiGLU
# Benchmark controls: environment variables only examples/ and benchmarks/ read. Every variable
# with this prefix is dropped from the environment a run inherits: an arm sets its own.
BENCH_ENV_PREFIX = "MEGATRON_PAGING_BENCH_"
IMPLEMENTATION_ENV = BENCH_ENV_PREFIX + "IMPLEMENTATION"  # mcore: Megatron-Core's own manager
LOSS_LOG_ENV = BENCH_ENV_PREFIX + "LOSS_LOG"  # every microbatch loss, exactly (float.hex)
MEMORY_FRACTION_ENV = BENCH_ENV_PREFIX + "MEMORY_FRACTION"  # the budget search's memory cap
MIB = 2**20
WARMUP_ITERS = 3  # dropped: 1 calibrates, 2 sizes the pools and Adam's state, 3 settles
FRONTIER_ITERS = 12  # -> 9 timed iterations per arm
BUDGET_ITERS = 7  # -> 4 timed iterations per budget candidate (2 left time per token noisy)
COMMON_FLAGS = ("--deterministic-mode",)  # every arm, every run


@dataclass(frozen=True)
class Arm:
    plan_arm: str  # the plan's arm this run is (megatron_paging.plan.arms)
    variant: str  # what the run changes beside the plan's arm ("" for none)
    paged: bool  # PAGED=1: the example script adds --moe-paged-stash and its pool flags
    flags: tuple[str, ...]
    exact: bool  # must reproduce the unpaged control bit for bit
    description: str
    env: dict = field(default_factory=dict)  # benchmark controls of the run

    @property
    def name(self) -> str:
        return arm_name(self.plan_arm, self.variant)


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("unpaged", "", False, (), False, "control: no paging, same static capacity"),
        Arm("unpaged", "unfused", False, (UNFUSED,), False,
            "the control with Megatron-Core's unfused activation expression instead of the "
            "fused weighted SwiGLU (Megatron's default bias_swiglu_fusion)"),
        Arm("paged", "", True, (), True, "--moe-paged-stash through megatron-paging"),
        Arm("paged", "hold", True, ("--paging-hold-last-slot",), True,
            "paged; the last layer before each backward is never copied and the pool is a "
            "layer smaller"),
        Arm("mcore", "", True, (), True,
            "--moe-paged-stash through Megatron-Core 0.19.2's own manager and Triton kernels",
            {IMPLEMENTATION_ENV: "mcore"}),
        Arm("recompute", "", False,
            ("--recompute-granularity", "selective", "--recompute-modules", "moe"), False,
            "unpaged; recompute the whole MoE layer in backward"),
        # core_attn only: layernorm recompute goes through CheckpointWithoutOutput, which needs
        # TE in Megatron-Core 0.19.2 (the example refuses it without TE).
        Arm("paged", "recompute_core_attn", True,
            ("--recompute-granularity", "selective", "--recompute-modules", "core_attn"), False,
            "paged + selective recompute of core attention"),
        # Fine-grained activation offloading of the expert modules. Ours moves live rows, by the
        # copy engine when CUDA_DEVICE_MAX_CONNECTIONS > 1 (--env), else by SM kernels.
        Arm("offload", "", False,
            (*OFFLOAD, "expert_fc1", "moe_act", OFFLOAD_BACKEND, "mcore"), True,
            "Megatron-Core's fine-grained offloading of the expert modules (unpaged)"),
        Arm("paged_offload_experts", "no_stash", False,
            (*OFFLOAD, "expert_fc1", "moe_act", OFFLOAD_BACKEND, "paged"), True,
            "our offloading backend for the expert modules (live rows only), without the "
            "paged stash"),
        Arm("paged_offload", "", True,
            (*OFFLOAD, "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
             OFFLOAD_BACKEND, "paged"), True,
            "experts paged on the device, dense modules offloaded through our backend"),
        # The experts save only x and recompute fc1 in backward (--paging-recompute-expert-fc1):
        # what paging or offloading moves per layer shrinks from hidden + fc1 columns to hidden.
        Arm("unpaged", "recompute_fc1", False, (RECOMPUTE_FC1,), True,
            "unpaged; the experts save x only and recompute fc1 (what paging x adds to)"),
        Arm("paged_recompute_fc1", "", True, (RECOMPUTE_FC1,), True,
            "paged; the experts save x only (one pool) and recompute fc1 in backward"),
        Arm("paged_recompute_fc1", "hold", True, (RECOMPUTE_FC1, "--paging-hold-last-slot"),
            True, "paged_recompute_fc1 with the last layer before each backward never copied"),
        Arm("paged_recompute_fc1", "tight", True,
            (RECOMPUTE_FC1, "--paging-hold-last-slot", CUDA_FACTOR, "1.0"), True,
            "paged_recompute_fc1.hold with the device tier at the calibrated peak, no headroom "
            "(CUDA factor 1.0: at EP = 1 every routed row is live, so the count never changes)"),
        Arm("paged_recompute_fc1", "spill", True,
            (RECOMPUTE_FC1, "--paging-hold-last-slot", CUDA_FACTOR, "0.72", CPU_FACTOR, "0.3"),
            True,
            "paged_recompute_fc1.hold with a device tier of 5 of the 7 paged layers' rows and a "
            "pinned-host tier for the rest (the layers stashed last spill)"),
        Arm("paged_offload_experts", "recompute_fc1_no_stash", False,
            (*OFFLOAD, "expert_fc1", OFFLOAD_BACKEND, "paged", RECOMPUTE_FC1), True,
            "our offloading of expert_fc1 alone, without the paged stash: the experts save x "
            "only and recompute fc1"),
    )
}  # fmt: skip
NAME_WIDTH = max(len(name) for name in ARMS)  # printed tables' arm column
# The control every other arm is compared with, the arm the recompute target is read against,
# and the arms that page (held to that target).
CONTROL, RECOMPUTE = "unpaged", "recompute"
PAGED_FAMILY = ("paged", "paged.hold", "paged.recompute_core_attn", "paged_recompute_fc1",
                "paged_recompute_fc1.hold", "paged_recompute_fc1.tight")
# Shown beside the recompute target, not part of its verdict: the offload arms (and the spill
# arm, for two of its layers) move live expert rows to the pinned host tier rather than keeping
# them on the device, a different trade; the unpaged fc1 recompute pages nothing (it shows what
# the fc1 recompute alone buys).
RECOMPUTE_INFORMATIONAL = ("paged_offload_experts.no_stash",
                           "paged_offload_experts.recompute_fc1_no_stash",
                           "paged_recompute_fc1.spill", "unpaged.recompute_fc1")
# The unpaged arm that runs the same model as each paged arm other than ``paged`` (whose is the
# control, in the verdicts themselves): paging's own cost is read against it, beside them.
SAME_MODEL_UNPAGED = {
    "paged.hold": CONTROL,
    "paged_recompute_fc1": "unpaged.recompute_fc1",
    "paged_recompute_fc1.hold": "unpaged.recompute_fc1",
    "paged_recompute_fc1.tight": "unpaged.recompute_fc1",
    "paged_recompute_fc1.spill": "unpaged.recompute_fc1",
}


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
#   37.7 MB.
# expert_heavy (32 experts top-4, moe-ffn 2048, seq 4096): experts 32 x (1024 x 4096 + 2048 x
#   1024) = 201M per layer -> ~1.71B parameters -> ~27 GB of state. Expert activations per
#   layer: 16384 live rows, 24576 capacity rows x (1024 + 2 x 2048) bf16 = 252 MB, 2.0 GB over 8
#   layers (1.34 GB live) against ~0.7 GB of other per-layer activations and ~0.8 GB of logits
#   (4096 x 32000, bf16 + fp32): the experts dominate the activation memory. Peak ~31 GB of the
#   H200's 141 GB. Step: 32768 tokens x ~1.8 GFLOP/token (6 x 268M active parameters + causal
#   attention) = ~59 TFLOP, ~0.2 s of GPU time at 300 TFLOP/s; the eager example's host issue
#   takes longer than that (host-bound), so 12 iterations are short next to start-up.
# expert_heavy_cap2 (not run by default): expert_heavy with capacity factor 2.0, the headroom a
#   static capacity needs for EP imbalance; there paging's saving is 1 - 1.1/2 of the expert
#   activations instead of 1 - 1.1/1.5.
# moe_compute (the default size): where recomputing the MoE layer costs more than the 1.2x the
#   recompute target needs. On expert_heavy and small the eager step is host-bound and
#   recomputing the MoE layer costs less than 1.2x unpaged, so even a free stash could not be
#   1.2x faster than recompute there. Here: 32 experts
#   top-8, moe-ffn 3072, seq 8192: experts 32 x (1024 x 6144 + 3072 x 1024) = 302M per layer ->
#   ~2.5B parameters -> ~40 GB of state; 65536 tokens per step x ~4.8 GFLOP/token (6 x 670M
#   active parameters + causal attention at 8192) = ~315 TFLOP, ~1 s of GPU time at 300 TFLOP/s,
#   so device work reaches the host's issue time, and recompute's extra MoE forward
#   (2 x 604M x 65536 = ~79 TFLOP) adds ~25%. Expert activations: 98304 capacity rows x 7168
#   bf16 columns = 1.4 GB per layer, 11.3 GB over 8 layers.
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
        Size("moe_compute",
             ("--num-experts", "32", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "3072",
              "--seq-length", "8192", "--max-position-embeddings", "8192"),
             "MoE compute dominates the step: 32 experts top-8, moe-ffn 3072, seq 8192"),
    )
}  # fmt: skip
# Its unpaged run needs an 80 GB GPU (peak_reserved_mib: results/frontier_moe_compute_h200.json).
DEFAULT_SIZES = ("moe_compute",)
# What a call runs without --arms: the control, paging, its alternatives, the tightest fc1 arm.
DEFAULT_ARMS = ("unpaged", "paged", "mcore", "recompute", "unpaged.recompute_fc1",
                "paged_recompute_fc1.tight", "offload",
                "paged_offload_experts.recompute_fc1_no_stash")
TARGET_SIZE = "moe_compute"  # where the recompute target is required
DEFAULT_BUDGET_ARMS = ("unpaged", "paged", "recompute")


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
        "recompute_expert_fc1": RECOMPUTE_FC1 in f,
    }


def expert_bytes(cfg: dict) -> dict:
    """Bytes of the paged expert tensors in flight at a step's peak, from the flags.

    Routed rows per microbatch and layer = seq x micro_batch x topk (EP = 1: every routed row
    lands on this rank, none is dropped under a capacity factor >= 1). The paged tensors of a
    layer are ``PagedGroupedMLP``'s fc1 input (``hidden`` columns) and fc1 output (``2 x moe_ffn``
    with SwiGLU, else ``moe_ffn``; none with ``--paging-recompute-expert-fc1``), in the
    activation dtype. In flight: every layer of the stage
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
    if cfg.get("recompute_expert_fc1"):
        ffn_cols = 0
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
