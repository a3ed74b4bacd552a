"""GPU: Megatron features a user may combine with paging, each trained paged and unpaged with the
feature on (the example, one GPU, deterministic mode): bitwise equal losses and gradient
checksums, or a one-line refusal at start-up naming the flag.

The features here are those that reach paging's code paths without a test elsewhere: gradient
reduction overlapped with the backward (its buckets fire from autograd hooks while our engine
reloads pages), Megatron's token-dropping expert capacity beside the static rank capacity,
the shared expert overlapped with dispatch, and PyTorch's FSDP2 in place of Megatron's DDP (whose
hooks reshard parameters around the layers that page). The router's padding for quantized GEMMs
needs fp8, hence Transformer Engine, and is not tested here."""

from __future__ import annotations

import pytest
import torch
from test_example_pretrain import MICROBATCHES, SMALL_POOL, _report, _train

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
}
# Megatron's validate_args: FSDP needs more than one hardware queue.
ENV = {"use-torch-fsdp2": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_example_feature_paged_bitwise_equal_to_unpaged(tmp_path, feature):
    flags, env = FEATURES[feature], ENV.get(feature)
    unpaged, _ = _train(tmp_path, paged=False, extra=flags, env_extra=env)
    paged, log = _train(tmp_path, paged=True, extra=flags, env_extra=env)
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
    unpaged, _ = _train(tmp_path, paged=False, extra=flags)
    paged, log = _train(tmp_path, paged=True, extra=flags)
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
    "overlap-grad-reduce+distributed-optimizer": FEATURES[
        "overlap-grad-reduce+distributed-optimizer"],
}


@pytest.mark.parametrize("feature", list(THROUGH_RERUN))
def test_example_feature_through_a_forced_rerun_paged_bitwise_equal_to_unpaged(tmp_path,
                                                                               feature):
    flags = THROUGH_RERUN[feature]
    unpaged, _ = _train(tmp_path, paged=False, extra=flags)
    paged, log = _train(tmp_path, paged=True,
                        extra=(*flags, *SMALL_POOL, "--paging-overflow-policy", "rerun"))
    assert "(policy rerun: " in log
    assert paged == unpaged and paged.grads == unpaged.grads
