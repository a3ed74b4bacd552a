"""GPU: the example trains a small GPT-MoE under torchrun, paged and unpaged, with bitwise equal
losses (deterministic mode, same seeds, same static capacity)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parent.parent
SMALL = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 512 "
    "--num-experts 4 --moe-ffn-hidden-size 256 --seq-length 256 --max-position-embeddings 256 "
    "--global-batch-size 4 --vocab-size 1024 --train-iters 3 --deterministic-mode"
).split()


def _train(
    tmp_path: Path, paged: bool, nproc: int = 1, extra: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    pytest.importorskip("megatron.training")
    loss_log = tmp_path / ("paged" if paged else "unpaged")
    env = {
        **os.environ,
        "PAGED": "1" if paged else "0",
        "NPROC": str(nproc),
        "PYTHON": sys.executable,
        "MEGATRON_PAGING_LOSS_LOG": str(loss_log),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "run_pretrain_1gpu.sh"), *SMALL, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    # Every rank that computes a loss (the last pipeline stage; every rank with EP) logs it.
    losses = []
    for rank_file in sorted(tmp_path.glob(f"{loss_log.name}.rank*")):
        losses += rank_file.read_text().split()[::2]
    return losses, log


def test_example_trains_paged_bitwise_equal_to_unpaged(tmp_path):
    unpaged, _ = _train(tmp_path, paged=False)
    paged, log = _train(tmp_path, paged=True)
    assert "megatron-paging installed" in log
    assert "paging_mode=paged" in log  # calibrated, then paged through pools
    assert len(unpaged) == 3 * 4  # 3 steps x 4 microbatches
    assert all(float.fromhex(v) == float.fromhex(v) for v in unpaged)  # no NaN
    assert paged == unpaged


@pytest.mark.multigpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices, found {torch.cuda.device_count()}",
)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("--expert-model-parallel-size", "2"), id="ep2"),
        # Several microbatches in flight per rank: where paging saves memory.
        pytest.param(("--pipeline-model-parallel-size", "2"), id="pp2"),
    ],
)
def test_example_two_gpus_paged_bitwise_equal_to_unpaged(tmp_path, extra):
    unpaged, _ = _train(tmp_path, paged=False, nproc=2, extra=extra)
    paged, log = _train(tmp_path, paged=True, nproc=2, extra=extra)
    assert "paging_mode=paged" in log
    assert unpaged and paged == unpaged


# -- forced overflow through Megatron (docs/overflow.md) -----------------------------------------
# A CUDA pool at 0.3x the calibrated peak cannot hold one step's records: every paged step
# overflows (step 1 calibrates and never overflows).
SMALL_POOL = ("--moe-paged-stash-buffer-size-factor-cuda", "0.3")


def test_example_forced_overflow_rerun_is_bitwise_equal_to_unpaged(tmp_path):
    unpaged, _ = _train(tmp_path, paged=False)
    paged, log = _train(
        tmp_path, paged=True, extra=(*SMALL_POOL, "--paging-overflow-policy", "rerun")
    )
    assert "page pool overflow" in log and "policy 'rerun'" in log
    # The rerun's losses are logged after the discarded attempt's: compare the last attempt of
    # every step, i.e. the unpaged control must appear as a suffix per step.
    per_step = len(unpaged) // 3
    assert paged[-per_step:] == unpaged[-per_step:]


@pytest.mark.parametrize("policy", ["skip", "grow"])
def test_example_forced_overflow_skip_and_grow(tmp_path, policy):
    extra = (*SMALL_POOL, "--paging-overflow-policy", policy, "--train-iters", "6")
    _, log = _train(tmp_path, paged=True, extra=extra)
    overflows = log.count("page pool overflow")
    assert overflows >= 1 and f"policy '{policy}'" in log
    if policy == "grow":
        assert "grew pool" in log
        # 0.3 x 1.5^k reaches the peak after a few steps; later steps no longer overflow.
        assert overflows < 5
