"""GPU: Megatron features a user may combine with paging, each trained paged and unpaged with the
feature on (the example, one GPU, deterministic mode): bitwise equal losses and gradient
checksums, or a one-line refusal at start-up naming the flag.

The features here are those that reach paging's code paths without a test elsewhere: gradient
reduction overlapped with the backward (its buckets fire from autograd hooks while our engine
reloads pages), Megatron's token-dropping expert capacity beside the static rank capacity,
the shared expert overlapped with dispatch, PyTorch's FSDP2 and Megatron-FSDP in place of
Megatron's DDP (whose hooks reshard parameters around the layers that page), and a checkpoint
saved and resumed. The router's padding for quantized GEMMs
needs fp8, hence Transformer Engine, and is not tested here."""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
from test_example_pretrain import (
    MICROBATCHES,
    SMALL_POOL,
    _report,
    _side_by_side,
    _train,
    _unpaged_and_paged,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.training_run,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHARED_EXPERT = ("--moe-shared-expert-intermediate-size", "256")
FEATURES = {
    "overlap-grad-reduce": ("--overlap-grad-reduce",),
    "overlap-grad-reduce+distributed-optimizer": (
        "--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"),
    "moe-expert-capacity-factor": ("--moe-expert-capacity-factor", "1.0"),
    "moe-shared-expert-overlap": (*SHARED_EXPERT, "--moe-shared-expert-overlap"),
    "use-torch-fsdp2": ("--use-torch-fsdp2", "--ckpt-format", "torch_dist"),
    "use-megatron-fsdp": ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"),
    # evaluation between training steps runs unpaged, through runners of its own
    "evaluation": ("--eval-iters", "2", "--eval-interval", "2"),
    # ... and under full-iteration graphs (calibrated at step 1, captured at 2, replayed at 3;
    # evaluation captures a graph of its own)
    "evaluation+cuda-graphs": ("--eval-iters", "1", "--eval-interval", "2", "--cuda-graph-impl",
                               "full_iteration", "--cuda-graph-warmup-steps", "1",
                               "--no-check-for-nan-in-loss-and-grad"),
    "micro-batch-size-2": ("--micro-batch-size", "2", "--global-batch-size", "8"),
    "calculate-per-token-loss": ("--calculate-per-token-loss",),
    # the first layer recomputed in the backward, the second paged
    "recompute-block": ("--recompute-granularity", "full", "--recompute-method", "block",
                        "--recompute-num-layers", "1"),
    "recompute-selective": (*SHARED_EXPERT, "--recompute-granularity", "selective",
                            "--recompute-modules", "core_attn", "shared_experts"),
    # DeepSeek-V3's attention with its up projections recomputed in the backward (their outputs
    # discarded after SDPA, whose saved inputs they are): the scale arm paged.recompute_mla_up_proj
    "recompute-mla-up-proj": (
        "--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32",
        "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64",
        "--kv-channels", "64", "--recompute-granularity", "selective",
        "--recompute-modules", "mla_up_proj"),
}
# Megatron's validate_args: FSDP needs more than one hardware queue.
ENV = {feature: {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
       for feature in ("use-torch-fsdp2", "use-megatron-fsdp")}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_example_feature_paged_bitwise_equal_to_unpaged(tmp_path, feature):
    flags, env = FEATURES[feature], ENV.get(feature)
    (unpaged, _), (paged, log) = _unpaged_and_paged(tmp_path, flags, env_extra=env)
    assert _report(log)["paging_mode"] == "paged"
    assert len(unpaged) == 3 * MICROBATCHES and len(unpaged.grads) == 3
    assert paged == unpaged and paged.grads == unpaged.grads


# Megatron's rerun state machine runs a step's forward-backward again in place, within one
# training iteration: here an injected transient error on the spiky-loss check, every step after
# the first (the first is never validated). The NaN check is turned off so the injection lands on
# the spike check, the one Megatron marks non-fatal (a transient error there continues with the
# rerun's result; on the fatal NaN check Megatron exits). Paging must serve both runs and leave
# the kept one equal to unpaged's.
RERUNS = {
    "spiky-loss-transient-error": (("--check-for-spiky-loss", "--no-check-for-nan-in-loss-and-grad",
                                    "--error-injection-rate", "1",
                                    "--error-injection-type", "transient_error"), 3 + 2),
}


@pytest.mark.parametrize("rerun", list(RERUNS))
def test_example_step_rerun_in_place_paged_bitwise_equal_to_unpaged(tmp_path, rerun):
    flags, least_steps = RERUNS[rerun]
    (unpaged, _), (paged, log) = _unpaged_and_paged(tmp_path, flags)
    report = _report(log)
    assert report["paging_mode"] == "paged"
    # every paging step begun, calibration included: the in-place reruns are among them
    assert int(report["paged_steps"]) >= least_steps, report["paged_steps"]
    assert "Injecting error type" in log and "Possible transient error" in log
    assert len(unpaged) == 3 * MICROBATCHES and len(unpaged.grads) == 3
    assert paged == unpaged and paged.grads == unpaged.grads


# Through a forced overflow rerun: DeepSeek-V3's aux-loss-free routing (Megatron updates the
# expert bias at the end of every forward-backward, so a rerun must start from the bias its step
# began with, which the runner restores) and gradient reduction overlapped with the backward (a
# rerun's buckets start from cleared buffers).
THROUGH_RERUN = {
    "expert-bias": ("--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"),
    # Qwen3's balancing: its global token counts are reset at the end of each forward-backward
    "global-aux-loss": ("--moe-router-load-balancing-type", "global_aux_loss"),
    "seq-aux-loss": ("--moe-router-load-balancing-type", "seq_aux_loss"),
    "overlap-grad-reduce+distributed-optimizer": FEATURES[
        "overlap-grad-reduce+distributed-optimizer"],
}


@pytest.mark.parametrize("feature", list(THROUGH_RERUN))
def test_example_feature_through_a_forced_rerun_paged_bitwise_equal_to_unpaged(tmp_path,
                                                                               feature):
    flags = THROUGH_RERUN[feature]
    (unpaged, _), (paged, log) = _unpaged_and_paged(
        tmp_path, flags, paged_extra=(*SMALL_POOL, "--paging-overflow-policy", "rerun"))
    assert "(policy rerun: " in log
    assert paged == unpaged and paged.grads == unpaged.grads


# Megatron's checkpoint save and resume (torch_dist; optimizer, RNG and data position included):
# a run stopped after step 2 (--exit-interval) and resumed from its checkpoint trains steps 3-4 as
# the uninterrupted run does, paged and unpaged alike. Paging keeps nothing in the checkpoint (the
# resumed run calibrates again at its first step); the experts save Megatron-Core's expert layout
# (mcore/experts_checkpoint.py), which the distributed optimizer's fully reshardable format
# also writes its states in.
RESUME = ("--train-iters", "4")
OPTIMIZER_FORMATS = {
    "distributed-optimizer": ("--use-distributed-optimizer",),
    "distributed-optimizer-fully-reshardable": ("--use-distributed-optimizer",
                                                "--dist-ckpt-optim-fully-reshardable"),
}


def _first_and_resumed(tmp_path, name, checkpoint, paged, flags, nproc):
    """The run stopped after step 2 with its checkpoint, then steps 3-4 resumed from it."""
    first, _ = _train(tmp_path / f"{name}_first", paged=paged, nproc=nproc,
                      extra=(*RESUME, *flags, "--save", checkpoint, "--save-interval", "2",
                             "--exit-interval", "2"))
    resumed, log = _train(tmp_path / f"{name}_resumed", paged=paged, nproc=nproc,
                          extra=(*RESUME, *flags, "--load", checkpoint))
    return first, resumed, log


def _stop_and_resume(tmp_path, paged: bool, flags=(), nproc: int = 1):
    """The uninterrupted run, its first two steps saved, and the two steps resumed from there."""
    name = "paged" if paged else "unpaged"
    checkpoint = str(tmp_path / f"{name}_checkpoint")
    # The uninterrupted run trains beside the stopped one and its resumption.
    (whole, _), (first, resumed, log) = _side_by_side(
        partial(_train, tmp_path / f"{name}_whole", paged=paged, nproc=nproc,
                extra=(*RESUME, *flags)),
        partial(_first_and_resumed, tmp_path, name, checkpoint, paged, flags, nproc))
    if nproc == 1:
        assert len(whole) == 4 * MICROBATCHES and len(whole.grads) == 4
        assert first == whole[:2 * MICROBATCHES] and first.grads == whole.grads[:2]
        assert resumed == whole[2 * MICROBATCHES:] and resumed.grads == whole.grads[2:]
    else:  # the ranks' lines follow one another, rank by rank: compared as multisets
        assert whole and sorted(first + resumed) == sorted(whole)
        assert sorted(first.grads + resumed.grads) == sorted(whole.grads)
    if paged:
        assert _report(log)["paging_mode"] == "paged"
    return whole


def test_example_checkpoint_resume_equals_the_uninterrupted_run_paged_and_unpaged(tmp_path):
    paged, unpaged = _side_by_side(partial(_stop_and_resume, tmp_path, paged=True),
                                   partial(_stop_and_resume, tmp_path, paged=False))
    assert paged == unpaged and paged.grads == unpaged.grads


@pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")),
                    reason="this Megatron-Core loads the distributed optimizer's state only with "
                    "Transformer Engine or Apex (without them the example refuses the resume: "
                    "test_example_preflight.py)")
@pytest.mark.parametrize("optimizer", list(OPTIMIZER_FORMATS))
def test_example_checkpoint_resume_with_the_distributed_optimizer(tmp_path, optimizer):
    _stop_and_resume(tmp_path, paged=True, flags=OPTIMIZER_FORMATS[optimizer])


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
def test_example_checkpoint_resume_with_two_expert_parallel_ranks(tmp_path):
    """Each EP rank saves and loads its own experts (mcore/experts_checkpoint.py): with one
    rank's experts on both, the resumed steps would differ."""
    _stop_and_resume(tmp_path, paged=True, flags=("--expert-model-parallel-size", "2"), nproc=2)
