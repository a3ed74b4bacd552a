"""Two frontier MoE layouts as Megatron flags, for one emulated rank each (bench_scale.py, the
planner's validation). Architectures from the models' published configs (../LAYOUTS in the
docs: docs/scale.md); parallel layouts from published Megatron recipes, with what differs said.

* ``deepseek_v3``: DeepSeek-V3 (arXiv 2412.19437): 61 layers (3 dense, 58 MoE), MLA, 256 routed
  experts top-8 + 1 shared, expert ffn 2048, vocab 129280. Training layout of the report: PP 16,
  EP 64, no TP, 2,048 GPUs (DP 128); the 61 layers over 32 virtual stages as Megatron-LM's
  DeepSeek-V3 layout string ``Et|(tt|)*30mL`` without its multi-token-prediction layer ``m``
  (left out: the example builds none). Router: Megatron's ``aux_loss`` (the report's
  auxiliary-loss-free bias and sequence-wise loss are not modelled; routing is emulated anyway).
* ``qwen3_235b``: Qwen3-235B-A22B: 94 MoE layers, GQA 64/4 heads, 128 experts top-8, expert ffn
  1536, qk-layernorm, vocab 151936. Layout of Megatron-Bridge's H100 BF16 Qwen3-235B-A22B
  pretraining preset (256 GPUs, PP 8, VP 4, EP 32, GBS 2048) with TP 1 instead of 2 (tensor-
  parallel collectives are not emulated); 94 layers plus embedding and loss over 32 virtual
  stages as ``Ett|(ttt|)*30ttL``.

Each run uses sequence 4096, micro-batch 1 and enough microbatches per step that the schedule
reaches its steady state (the microbatches in flight at the peak do not depend on more).

This rank's own tokens are routed by random logits (Megatron's benchmark flag
``--moe-router-force-load-balancing``); what peers send follows the load model. A model at
initialisation on mock data routes stage 0's own tokens so unevenly that at capacity factor 2 most
steps exceed the static budget and rerun without it (needing the unpaged peak): that measures
the mock data, not a trained router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arm_names import arm_name
from hot_step import FITS_POOL_SCALE

COMMON = (
    "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
    "--transformer-impl local --normalization RMSNorm --swiglu --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights "
    "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend static "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 "
    "--moe-router-force-load-balancing --use-distributed-optimizer --bf16 --fake-process-group"
).split()


@dataclass(frozen=True)
class Layout:
    name: str
    model: tuple[str, ...]
    parallel: tuple[str, ...]
    world_size: int
    pp: int
    microbatches: int  # per step
    dp: int
    ranks: tuple[int, ...]  # the emulated ranks: the largest memory first, then another stage
    source: str

    def flags(self, rank: int) -> list[str]:
        del rank  # every rank runs the same flags; RANK picks the stage
        gbs = self.microbatches * self.dp
        return [*COMMON, *self.model, *self.parallel, "--global-batch-size", str(gbs)]

    def env(self, rank: int) -> dict[str, str]:
        return {"WORLD_SIZE": str(self.world_size), "RANK": str(rank)}

    def stage(self, rank: int) -> int:
        return rank // (self.world_size // self.pp)


DEEPSEEK_V3 = Layout(
    name="deepseek_v3",
    model=tuple((
        "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128 --kv-channels 128 "
        "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
        "--moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid "
        "--moe-router-num-groups 8 --moe-router-group-topk 4 --vocab-size 129280"
    ).split()) + ("--moe-layer-freq", "([0]*3+[1]*58)"),
    parallel=("--pipeline-model-parallel-size", "16", "--expert-model-parallel-size", "64",
              "--pipeline-model-parallel-layout", "Et|(tt|)*30L"),
    world_size=2048, pp=16, microbatches=32, dp=128,
    # stage 2 holds four MoE layers and the second-most microbatches in flight; stage 15 the loss
    ranks=(2 * 128, 15 * 128),
    source="DeepSeek-V3 technical report (arXiv 2412.19437): PP 16, EP 64, 2048 GPUs; "
           "Megatron-LM's layout string without MTP",
)

QWEN3_235B = Layout(
    name="qwen3_235b",
    model=tuple((
        "--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm "
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536 "
        "--moe-router-score-function softmax --vocab-size 151936 --rotary-base 1000000"
    ).split()),
    parallel=("--pipeline-model-parallel-size", "8", "--expert-model-parallel-size", "32",
              "--pipeline-model-parallel-layout", "Ett|(ttt|)*30ttL"),
    world_size=256, pp=8, microbatches=16, dp=32,
    ranks=(0, 7 * 32),  # stage 0: embedding and the most microbatches in flight; stage 7: loss
    source="Megatron-Bridge QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_BF16 (256 GPUs, TP 2, PP 8, "
           "VP 4, EP 32) with TP 1",
)

LAYOUTS = {layout.name: layout for layout in (DEEPSEEK_V3, QWEN3_235B)}


@dataclass(frozen=True)
class Arm:
    plan_arm: str  # the plan's arm this run is (megatron_paging.plan.arms)
    variant: str  # what the run changes beside the plan's arm ("" for none)
    flags: tuple[str, ...]
    env: dict = field(default_factory=dict)
    hot_step: bool = False  # replays hot_step.py's trace (one step with more rows)
    pool_scale: float = 1.0  # times the planned pool factor
    layouts: tuple[str, ...] | None = None  # the layouts it applies to (None: every one)

    @property
    def name(self) -> str:
        return arm_name(self.plan_arm, self.variant)


EXPERT_OFFLOAD = ("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
                  "moe_act", "--paging-offload-backend")
CONNECTIONS_32 = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
MLA_UP_PROJ_RECOMPUTE = ("--recompute-granularity", "selective", "--recompute-modules",
                         "mla_up_proj")
# Named as benchmarks/arm_names.py says. Capacity factor 2 runs all; 1.5 and 3 the first two.
ARMS = {a.name: a for a in (
    Arm("unpaged", "", ()),
    Arm("paged", "", ("--moe-paged-stash",)),
    Arm("mcore", "", ("--moe-paged-stash",), {"MEGATRON_PAGING_BENCH_IMPLEMENTATION": "mcore"}),
    Arm("recompute", "", ("--recompute-granularity", "selective", "--recompute-modules", "moe")),
    Arm("offload", "", (*EXPERT_OFFLOAD, "mcore")),
    Arm("paged_offload_experts", "", ("--moe-paged-stash", *EXPERT_OFFLOAD, "paged")),
    Arm("paged_recompute_fc1", "", ("--moe-paged-stash", "--paging-recompute-expert-fc1")),
    # Paging with MLA's up projections recomputed (DeepSeek-V3's attention keeps ~3/4 less):
    # what may let a stage whose paged arm does not fit run without MoE recompute or offload.
    Arm("paged", "recompute_mla_up_proj", ("--moe-paged-stash", *MLA_UP_PROJ_RECOMPUTE),
        layouts=("deepseek_v3",)),
    # The offload arms with more hardware queues (the example defaults to one): a copy-engine
    # copy then runs beside the compute, Megatron-Core's whole buffers and our live-row prefix
    # alike (docs/offload.md). Which of the two settings is faster is the layout's to say.
    Arm("offload", "connections_32", (*EXPERT_OFFLOAD, "mcore"), CONNECTIONS_32),
    Arm("paged_offload_experts", "connections_32", ("--moe-paged-stash", *EXPERT_OFFLOAD, "paged"),
        CONNECTIONS_32),
    # The control of one stream per offload pool: every offloaded live row on the paging stream
    # (with one queue a copy queued there behind another pool's PCIe copy holds every launch).
    Arm("paged_offload_experts", "one_paging_stream",
        ("--moe-paged-stash", *EXPERT_OFFLOAD, "paged"),
        {"MEGATRON_PAGING_BENCH_ONE_PAGING_STREAM": "1"}),
    # The paged stash with more hardware queues too, so that each side of the fastest-fit
    # comparison (scale_summary.py) gets its faster setting (our paged offload ran 14% faster
    # with 32 on DeepSeek-V3's last stage; the stash alone is unmeasured).
    Arm("paged", "connections_32", ("--moe-paged-stash",), CONNECTIONS_32),
    # The parity pair: deterministic kernels, so paged and unpaged can be compared bit for bit
    # (the arms above run as users launch them, where atomics make two runs of one arm differ).
    Arm("unpaged", "deterministic", ("--deterministic-mode",)),
    Arm("paged", "deterministic", ("--moe-paged-stash", "--deterministic-mode")),
    # The rerun pair (hot_step.py): one step overflows the planned pool and reruns; the twin's
    # pool holds it. Their times for that step differ by the rerun. Not memory measurements.
    Arm("paged", "hot_step", ("--moe-paged-stash",), hot_step=True),
    Arm("paged", "hot_step_fits", ("--moe-paged-stash",), hot_step=True,
        pool_scale=FITS_POOL_SCALE),
    # The same pair with MLA's up projections recomputed: the rerun grows the device pool by
    # about half, which DeepSeek-V3's last-stage paged arm (1 GiB under an 80 GB GPU) cannot
    # hold; this arm leaves ~20 GiB for it (docs/scale.md).
    Arm("paged", "recompute_mla_up_proj_hot_step", ("--moe-paged-stash", *MLA_UP_PROJ_RECOMPUTE),
        hot_step=True, layouts=("deepseek_v3",)),
    Arm("paged", "recompute_mla_up_proj_hot_step_fits",
        ("--moe-paged-stash", *MLA_UP_PROJ_RECOMPUTE), hot_step=True, pool_scale=FITS_POOL_SCALE,
        layouts=("deepseek_v3",)),
)}
PARITY_PAIR = ("unpaged.deterministic", "paged.deterministic")
# (overflowing arm, its twin whose pool holds the hot step)
RERUN_PAIRS = (("paged.hot_step", "paged.hot_step_fits"),
               ("paged.recompute_mla_up_proj_hot_step",
                "paged.recompute_mla_up_proj_hot_step_fits"))
RERUN_ARMS = tuple(name for pair in RERUN_PAIRS for name in pair)
MEMORY_ARMS = tuple(name for name, arm in ARMS.items() if not arm.hot_step)  # the plan's to predict
CAPACITY_FACTORS = {2.0: tuple(ARMS), 1.5: ("unpaged", "paged"), 3.0: ("unpaged", "paged")}
# Paged arms get the device pool factor that `megatron-paging plan` gives for this overflow rate
# (a rerun costs about one step, so 1e-2 costs about 1% of the step time on average).
POOL_OVERFLOW_RATE = 1e-2
