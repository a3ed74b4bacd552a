"""The frontier's arms and model sizes, the flags each run appends to the example script, and
the memory arithmetic computed from a run's flags (live expert bytes, sizing estimate)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_pretrain_1gpu.sh"
# The offloading arms need this flag in the example's parser (megatron_paging/mcore/flags.py has it
# since the offloading backend landed; the check stays for trees that predate it).
FLAGS_SOURCE = ROOT / "megatron_paging" / "mcore" / "flags.py"
OFFLOAD_FLAG = "--paging-offload-backend"
RECOMPUTE_FC1 = "--paging-recompute-expert-fc1"
CUDA_FACTOR = "--moe-paged-stash-buffer-size-factor-cuda"  # Megatron-Core's pool flags
CPU_FACTOR = "--moe-paged-stash-buffer-size-factor-cpu"
UNFUSED = "--no-bias-swiglu-fusion"  # the example fuses the experts' weighted SwiGLU
MIB = 2**20
WARMUP_ITERS = 3  # dropped: 1 calibrates, 2 sizes the pools and Adam's state, 3 settles
FRONTIER_ITERS = 12  # -> 9 timed iterations per arm
BUDGET_ITERS = 7  # -> 4 timed iterations per budget candidate (2 gave time/token spreads of ~10%)
COMMON_FLAGS = ("--deterministic-mode",)  # every arm, every run


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
        Arm("unpaged_unfused", False, (UNFUSED,), False,
            "the control with Megatron-Core's unfused activation expression (every arm before "
            "the fused weighted SwiGLU, Megatron's default bias_swiglu_fusion)"),
        Arm("paged", True, (), True, "--moe-paged-stash through megatron-paging"),
        Arm("paged_hold", True, ("--paging-hold-last-slot",), True,
            "paged; a layer is stashed when the next commits, so the last layer before each "
            "backward is never copied and the pool is a layer smaller"),
        Arm("paged_prefetch_dispatcher", True, ("--paging-prefetch-point", "dispatcher"), True,
            "paged; a layer's backward ends (and the layer below is reloaded) after the static "
            "dispatcher's backward instead of the experts', so the reloads run beside the "
            "attention's backward rather than the dispatcher's memory-bound gathers"),
        Arm("paged_stash_next_layer", True, ("--paging-stash-point", "next-layer"), True,
            "paged; a layer's stash is issued when the next layer's experts begin (beside their "
            "GEMMs, not beside the combine's gathers), the newest layer held as with "
            "--paging-hold-last-slot"),
        Arm("paged_persistent", True, ("--paging-pool-residency", "persistent"), True,
            "paged; the pool's pages kept across steps (the residency full-iteration graphs "
            "use) instead of returned after each eager step: at a memory cap, whether taking "
            "them again every step is what makes the allocator retry"),
        Arm("paged_unbounded_lead", True, ("--paging-max-inflight-stashes", "0"), True,
            "paged; no bound on the layers whose stash inputs are allocated at once (the "
            "behaviour before --paging-max-inflight-stashes): when the GPU lags, every layer "
            "committed ahead of its copy keeps its capacity-sized inputs beside the pool"),
        Arm("mcore_manager", True, ("--paging-implementation", "mcore"), True,
            "--moe-paged-stash through Megatron-Core 0.19.2's own manager and Triton kernels"),
        Arm("recompute_moe", False,
            ("--recompute-granularity", "selective", "--recompute-modules", "moe"), False,
            "unpaged; recompute the whole MoE layer in backward"),
        # core_attn only: layernorm recompute goes through CheckpointWithoutOutput, which needs
        # TE in Megatron-Core 0.19.2 (REMOVED_ARMS; megatron_paging/mcore/flags.py refuses it).
        Arm("paged_recompute_core_attn", True,
            ("--recompute-granularity", "selective", "--recompute-modules", "core_attn"), False,
            "paged + selective recompute of core attention"),
        # Offloading (docs/offload.md): bitwise equal to the control for both backends (measured
        # on the H200, benchmarks/results/mcore_offload_h200.json).
        Arm("mcore_offload", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             "moe_act", OFFLOAD_FLAG, "mcore"), True,
            "Megatron-Core's fine-grained offloading of the expert modules (unpaged; its TE "
            "cpu_offload switch faked, TE being absent)", True),
        Arm("paged_offload", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             "moe_act", OFFLOAD_FLAG, "paged"), True,
            "our paged offloading backend for the expert modules (live rows only)", True),
        Arm("paged_offload_dma", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             "moe_act", OFFLOAD_FLAG, "paged", "--paging-offload-dma-prefix", "1"), True,
            "paged_offload with the copy engine moving each buffer's first rows (the "
            "calibrated smallest live count), the kernels only the rest", True),
        Arm("paged_stash_plus_offload", True,
            ("--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
             "qkv_linear", "core_attn", "attn_proj", "mlp_norm", OFFLOAD_FLAG, "paged"), True,
            "experts paged on the device, dense modules offloaded through our backend", True),
        # The experts save only x and recompute fc1 in backward (--paging-recompute-expert-fc1):
        # what paging or offloading moves per layer shrinks from hidden + fc1 columns to hidden.
        Arm("unpaged_recompute_fc1", False, (RECOMPUTE_FC1,), True,
            "unpaged; the experts save x only and recompute fc1 (what paging x adds to)"),
        Arm("paged_recompute_fc1", True, (RECOMPUTE_FC1,), True,
            "paged; the experts save x only (one pool) and recompute fc1 in backward"),
        Arm("paged_recompute_fc1_hold", True, (RECOMPUTE_FC1, "--paging-hold-last-slot"), True,
            "paged_recompute_fc1 with the last layer before each backward kept, never copied: "
            "the pool of x's rows one layer smaller (not yet run)"),
        Arm("paged_recompute_fc1_tight", True,
            (RECOMPUTE_FC1, "--paging-hold-last-slot", CUDA_FACTOR, "1.0"), True,
            "paged_recompute_fc1_hold with the device tier at the calibrated peak, no headroom "
            "(CUDA factor 1.0: at EP = 1 every routed row is live, so the count never changes)"),
        Arm("paged_recompute_fc1_spill", True,
            (RECOMPUTE_FC1, "--paging-hold-last-slot", CUDA_FACTOR, "0.72", CPU_FACTOR, "0.3"),
            True,
            "paged_recompute_fc1_hold with a device tier of 5 of the 7 paged layers' rows and a "
            "pinned-host tier for the rest (the layers stashed last spill)"),
        Arm("paged_recompute_fc1_pieces", True,
            (RECOMPUTE_FC1, RECOMPUTE_FC1 + "-piece-rows", "49152", UNFUSED), False,
            "paged_recompute_fc1 with Megatron's unfused activation in pieces of 49152 rows "
            "(moe_compute: two pieces; pieces shrink the unfused expression's fp32 "
            "temporaries, which the fused SwiGLU does not make; 16384 rows ran at a4348fe)"),
        Arm("paged_offload_dma_recompute_fc1", False,
            ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
             OFFLOAD_FLAG, "paged", "--paging-offload-dma-prefix", "1", RECOMPUTE_FC1), True,
            "paged_offload_dma of expert_fc1 alone: the experts save x only and recompute fc1",
            True),
    )
}  # fmt: skip
# The control every other arm is compared with, and the arms that page (recompute target).
CONTROL = "unpaged"
PAGED_FAMILY = ("paged", "paged_hold", "paged_prefetch_dispatcher", "paged_stash_next_layer",
                "paged_recompute_core_attn", "paged_recompute_fc1", "paged_recompute_fc1_hold",
                "paged_recompute_fc1_tight", "paged_recompute_fc1_pieces")
# Shown beside the recompute target, not part of its verdict: the offload arms (and the spill
# arm, for two of its layers) page live expert rows to the pinned host tier rather than keeping
# them on the device, a different trade; the unpaged fc1 recompute pages nothing (it shows what
# the fc1 recompute alone buys).
RECOMPUTE_INFORMATIONAL = ("paged_offload", "paged_offload_dma", "paged_offload_dma_recompute_fc1",
                           "paged_recompute_fc1_spill", "unpaged_recompute_fc1")
# The unpaged arm that runs the same model as each paged arm other than ``paged`` (whose is the
# control, in the verdicts themselves): paging's own cost is read against it, beside them.
SAME_MODEL_UNPAGED = {
    "paged_hold": CONTROL,
    "paged_prefetch_dispatcher": CONTROL,
    "paged_stash_next_layer": CONTROL,
    "paged_recompute_fc1": "unpaged_recompute_fc1",
    "paged_recompute_fc1_hold": "unpaged_recompute_fc1",
    "paged_recompute_fc1_tight": "unpaged_recompute_fc1",
    "paged_recompute_fc1_spill": "unpaged_recompute_fc1",
}
# Arms a resumed file may still hold: listed by the report, never summarized or run.
REMOVED_ARMS = {
    "paged_recompute_attn_norm": (
        "replaced by paged_recompute_core_attn: --recompute-modules layernorm crashed without "
        "Transformer Engine (Megatron-Core 0.19.2's CheckpointWithoutOutput calls TE's "
        "FP8GlobalStateManager even without fp8)"),
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
# moe_compute (not run by default: --only moe_compute:<arm>): where recomputing the MoE layer
#   costs more than the 1.2x the recompute target needs. On expert_heavy and small recompute
#   costs only ~1.17x unpaged (frontier_h200.json): the step is host-bound (~0.7 of ~1.1 s is
#   device work), so even a free stash could not be 1.2x faster than recompute. Here: 32 experts
#   top-8, moe-ffn 3072, seq 8192: experts 32 x (1024 x 6144 + 3072 x 1024) = 302M per layer ->
#   ~2.5B parameters -> ~40 GB of state; 65536 tokens per step x ~4.8 GFLOP/token (6 x 670M
#   active parameters + causal attention at 8192) = ~315 TFLOP, ~1 s of GPU time at 300 TFLOP/s,
#   so device work reaches the host's ~1 s, and recompute's extra MoE forward (2 x 604M x 65536 =
#   ~79 TFLOP) adds ~25%. Expert activations: 98304 capacity rows x 7168 bf16 columns = 1.4 GB
#   per layer, 11.3 GB over 8 layers.
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
