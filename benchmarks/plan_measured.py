"""The validation set of the plan's model: measured H200 memory of the one-GPU example
(examples/run_pretrain_1gpu.sh) and two larger one-GPU sizes, read from
``results/plan_validation_set_h200.json``, and the launch line that plans each run.

Each :class:`Record` is one run: the size, the arm (named as benchmarks/arm_names.py says; its
result file may carry the old name, arm_names.OLD_NAMES), the commit that ran it, its result
file, and what examples/step_probe.py reported. ``small`` is the example's
own model; ``expert_heavy`` and ``moe_compute`` are the frontier benchmark's sizes
(benchmarks/frontier/arms.py). Runs of code without the fused expert activation ran it as
Megatron-Core's unfused torch expression, which the current code runs under
``--no-bias-swiglu-fusion``: :data:`CODE_FLAGS` adds it for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    unfused_activation: bool  # the code ran Megatron-Core's unfused expert activation
    pool_kept_across_steps: bool  # the device pages stayed allocated between steps

    def as_measured(self) -> dict:
        """The record in the form ``plan_validation.compare`` reads."""
        keys = ("steady_peak_allocated_mib", "steady_fb_peak_allocated_mib", "param_mib",
                "grad_mib", "optimizer_state_mib", "pool_cuda_mib")
        return {key: getattr(self, key) for key in keys}


RESULT = Path(__file__).resolve().parent / "results" / "plan_validation_set_h200.json"


def load_records(path: Path = RESULT) -> tuple[Record, ...]:
    """The measured runs of ``path`` (the committed validation set by default)."""
    runs = json.loads(path.read_text())["runs"]
    return tuple(Record(**run) for run in runs)


RECORDS = load_records()


def line_for(record: Record) -> list[str]:
    """The launch line that plans ``record``: the example, the size, the arm's pool or model
    flags, and the code era's activation."""
    extra = VARIANT_FLAGS.get(record.arm, ())
    unfused = record.unfused_activation and "--no-bias-swiglu-fusion" not in extra
    code = CODE_FLAGS if unfused else ()
    return [*EXAMPLE_LINE, *PAGING_LINE, *SIZES[record.size], *extra, *code]


__all__ = ["CODE_FLAGS", "EXAMPLE_LINE", "FIT_ARM", "FIT_SIZE", "PAGING_LINE",
           "RECORDS", "RESULT", "Record", "SIZES",
           "VARIANT_FLAGS", "line_for", "load_records"]
