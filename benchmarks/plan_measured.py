"""Measured H200 memory of the one-GPU example (examples/run_pretrain_1gpu.sh) and two larger
one-GPU sizes, kept here as data: the validation set of the plan's model.

Each :class:`Record` is one run: the size, the arm (named as benchmarks/arm_names.py says; its
result file may carry the old name, arm_names.OLD_NAMES), the commit that ran it, its result
file, and what examples/step_probe.py reported. ``small`` is the example's
own model; ``expert_heavy`` and ``moe_compute`` are the frontier benchmark's sizes
(benchmarks/frontier/arms.py). Runs of code without the fused expert activation ran it as
Megatron-Core's unfused torch expression, which the current code runs under
``--no-bias-swiglu-fusion``: :data:`CODE_FLAGS` adds it for them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The example's line (DRY_RUN=1 bash examples/run_pretrain_1gpu.sh, without its paging flags).
EXAMPLE_LINE = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 "
    "--seq-length 2048 --max-position-embeddings 2048 --transformer-impl local "
    "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --no-persist-layer-norm "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1024 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32 "
    "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend static "
    "--moe-expert-rank-capacity-factor 1.5 --micro-batch-size 1 --global-batch-size 8 "
    "--train-iters 20 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 "
    "--weight-decay 0.1 --clip-grad 1.0 --bf16 --seed 1234 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --log-interval 1 --eval-iters 0 "
    "--eval-interval 100000 --deterministic-mode"
).split()
PAGING_LINE = ("--moe-paged-stash --moe-paged-stash-page-size 64 "
               "--moe-paged-stash-buffer-size-factor-cuda 1.10").split()
SIZES = {
    "small": (),
    "expert_heavy": ("--num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2048 "
                     "--seq-length 4096 --max-position-embeddings 4096").split(),
    "moe_compute": ("--num-experts 32 --moe-router-topk 8 --moe-ffn-hidden-size 3072 "
                    "--seq-length 8192 --max-position-embeddings 8192").split(),
}
# Flags a variant's runs added to the size's line beyond what the plan's arm models.
VARIANT_FLAGS = {
    "paged_recompute_fc1.tight": ("--paging-hold-last-slot",
                                  "--moe-paged-stash-buffer-size-factor-cuda", "1.0"),
    "unpaged.unfused": ("--no-bias-swiglu-fusion",),
}
# Runs whose device pages stayed allocated across steps: the paged.persistent arm, and every
# paged run of code that still kept the device tier between eager steps (PERSISTENT_COMMITS).
PERSISTENT_POOL = {"paged.persistent"}
PERSISTENT_COMMITS = {"7b2a615"}
# Commits of code without the fused weighted SwiGLU: the unfused expression ran.
UNFUSED_COMMITS = {"60d7032", "ca915e0", "7b2a615", "ca36af7", "08f6a80"}
CODE_FLAGS = ("--no-bias-swiglu-fusion",)
FIT_SIZE, FIT_ARM = "small", "unpaged"  # the one-GPU example: the constants' only fit


@dataclass(frozen=True)
class Record:
    size: str
    arm: str
    commit: str
    source: str
    steady_peak_allocated_mib: float
    steady_fb_peak_allocated_mib: float
    param_mib: float
    grad_mib: float
    optimizer_state_mib: float
    pool_cuda_mib: float

    @property
    def old_code(self) -> bool:
        return self.commit in UNFUSED_COMMITS

    @property
    def persistent_pool(self) -> bool:
        return self.arm in PERSISTENT_POOL or self.commit in PERSISTENT_COMMITS

    def as_measured(self) -> dict:
        """The record in the form ``plan_validation.compare`` reads."""
        keys = ("steady_peak_allocated_mib", "steady_fb_peak_allocated_mib", "param_mib",
                "grad_mib", "optimizer_state_mib", "pool_cuda_mib")
        return {key: getattr(self, key) for key in keys}


def _records(rows) -> tuple[Record, ...]:
    return tuple(Record(size, arm, commit, source, *values)
                 for size, arm, commit, source, values in rows)


F = "frontier_h200.json"
MC = "frontier_moe_compute_manager_same_call_h200.json"
PP = "frontier_moe_compute_prefetch_point_h200.json"
FS = "frontier_moe_compute_fused_swiglu_h200.json"
RECORDS = _records([
    ("small", "unpaged", "60d7032", F, (10222.4, 9727.2, 957.3, 1914.6, 5743.7, 0.0)),
    ("small", "paged", "60d7032", F, (10222.5, 9687.7, 957.3, 1914.6, 5743.7, 211.5)),
    ("small", "mcore", "60d7032", F, (10435.0, 9687.7, 957.3, 1914.6, 5743.7, 211.5)),
    ("small", "recompute", "60d7032", F, (10287.4, 9437.7, 957.3, 1914.6, 5743.7, 0.0)),
    ("small", "offload", "ca915e0", F, (10222.4, 9475.2, 957.3, 1914.6, 5743.7, 0.0)),
    ("small", "paged_offload", "ca915e0", F,
     (10222.5, 9434.7, 957.3, 1914.6, 5743.7, 211.5)),
    ("small", "paged.persistent", "ca36af7", F, (10435.0, 9687.7, 957.3, 1914.6, 5743.7, 211.5)),
    ("expert_heavy", "unpaged", "60d7032", F, (35579.2, 33420.7, 3261.5, 6523.1, 19569.2, 0.0)),
    ("expert_heavy", "paged", "60d7032", F, (35579.3, 33149.0, 3261.5, 6523.1, 19569.2, 1408.1)),
    ("expert_heavy", "mcore", "60d7032", F,
     (36987.4, 33148.5, 3261.5, 6523.1, 19569.2, 1408.1)),
    ("expert_heavy", "recompute", "60d7032", F,
     (35707.2, 31750.7, 3261.5, 6523.1, 19569.2, 0.0)),
    ("expert_heavy", "offload", "7b2a615", F,
     (35579.2, 31740.7, 3261.5, 6523.1, 19569.2, 0.0)),
    ("expert_heavy", "paged_offload", "7b2a615", F,
     (36987.4, 32644.5, 3261.5, 6523.1, 19569.2, 1408.1)),
    ("expert_heavy", "paged.persistent", "ca36af7", F,
     (36987.4, 33149.0, 3261.5, 6523.1, 19569.2, 1408.1)),
    ("moe_compute", "unpaged", "ca14794", MC, (57632.0, 57632.0, 4797.5, 9595.1, 28785.2, 0.0)),
    ("moe_compute", "paged", "ca14794", MC, (56111.0, 56111.0, 4797.5, 9595.1, 28785.2, 7885.5)),
    ("moe_compute", "mcore", "ca14794", MC,
     (60395.3, 56111.0, 4797.5, 9595.1, 28785.2, 7885.5)),
    ("moe_compute", "recompute", "5e0b255", PP,
     (52764.5, 48243.3, 4797.5, 9595.1, 28785.2, 0.0)),
    ("moe_compute", "paged_recompute_fc1.tight", "5e0b255", PP,
     (52508.6, 47968.2, 4797.5, 9595.1, 28785.2, 896.0)),
    ("moe_compute", "paged_recompute_fc1", "0145ba5", FS,
     (52508.7, 48784.3, 4797.5, 9595.1, 28785.2, 1126.5)),
    ("moe_compute", "unpaged.unfused", "0145ba5", FS,
     (62625.1, 62625.1, 4797.5, 9595.1, 28785.2, 0.0)),
    ("moe_compute", "unpaged.recompute_fc1", "bc61800",
     "frontier_moe_compute_same_model_h200.json",
     (52508.5, 48416.0, 4797.5, 9595.1, 28785.2, 0.0)),
    ("moe_compute", "offload", "08f6a80", "frontier_moe_compute_conn32_h200.json",
     (53408.6, 53408.6, 4797.5, 9595.1, 28785.2, 0.0)),
])


def line_for(record: Record) -> list[str]:
    """The launch line that plans ``record``: the example, the size, the arm's pool or model
    flags, and the code era's activation."""
    extra = VARIANT_FLAGS.get(record.arm, ())
    code = CODE_FLAGS if record.old_code and "--no-bias-swiglu-fusion" not in extra else ()
    return [*EXAMPLE_LINE, *PAGING_LINE, *SIZES[record.size], *extra, *code]


__all__ = ["CODE_FLAGS", "EXAMPLE_LINE", "FIT_ARM", "FIT_SIZE", "PAGING_LINE",
           "PERSISTENT_COMMITS", "PERSISTENT_POOL", "RECORDS", "Record", "SIZES", "VARIANT_FLAGS",
           "line_for"]
