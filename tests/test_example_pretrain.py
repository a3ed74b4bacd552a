"""GPU: the example trains a small GPT-MoE under torchrun, paged and unpaged, with bitwise equal
losses (deterministic mode, same seeds, same static capacity); eagerly and under Megatron's
full-iteration CUDA graphs; every overflow policy handles a forced overflow; and fine-grained
activation offloading (ours, alone and beside the paged stash, eager and graphed; Megatron-Core's
as the baseline) leaves every microbatch loss bitwise equal to the run without it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.training_run,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parent.parent
SMALL = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 512 "
    "--num-experts 4 --moe-ffn-hidden-size 256 --seq-length 256 --max-position-embeddings 256 "
    "--global-batch-size 4 --vocab-size 1024 --train-iters 3 --deterministic-mode"
).split()
MICROBATCHES = 4
# Full-iteration graphs: 3 eager warm-up steps (step 1 calibrates), capture at step 4, replays.
GRAPH_STEPS = 20
GRAPHS = (
    "--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "3",
    "--no-check-for-nan-in-loss-and-grad", "--train-iters", str(GRAPH_STEPS),
)  # fmt: skip
EAGER_LONG = ("--no-check-for-nan-in-loss-and-grad", "--train-iters", str(GRAPH_STEPS))
CAPTURE_LINE = "Capture CUDA graph for training"
REPORT = re.compile(r"paging-example rank \d+: (.*)")
KERNELS = re.compile(r"paging-example kernels iteration=(\d+) count=(\d+)")
PORT_TAKEN = re.compile(r"DistNetworkError: The server socket has failed to listen.*EADDRINUSE")


def _free_port() -> int:
    # torchrun's default port would collide when pytest-xdist workers share the machine.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Exit codes of Megatron's rerun state machine (megatron/core/rerun_state_machine.py).
MEGATRON_EXIT_CODES = {16: " (Megatron: resume from a checkpoint to disambiguate a result)",
                       17: " (Megatron: a result failed validation)"}


def _cause(returncode: int, log: str) -> str:
    """The run's exit code and its last error line: the first line of a failed assertion, which
    the GPU suite's summary (tests/suite_stream.py) records."""
    errors = [line.strip() for line in log.splitlines()
              if re.search(r"^\W*(error:|\w*(Error|Exception)\b)", line.strip())]
    cause = errors[-1] if errors else "no error line in its output"
    workers = re.findall(r"exitcode\s*:\s*(-?\d+)", log)  # torchrun's report of its worker
    code = int(workers[-1]) if workers else returncode
    return f"exit {code}{MEGATRON_EXIT_CODES.get(code, '')}: {cause}"


def _train(
    tmp_path: Path, paged: bool, nproc: int = 1, extra: tuple[str, ...] = (), env_extra=None,
    base: tuple[str, ...] = tuple(SMALL),
) -> tuple[list[str], str]:
    pytest.importorskip("megatron.training")
    tmp_path.mkdir(parents=True, exist_ok=True)
    loss_log = tmp_path / ("paged" if paged else "unpaged")
    env = {
        **os.environ,
        "PAGED": "1" if paged else "0",
        "NPROC": str(nproc),
        "PYTHON": sys.executable,
        "MEGATRON_PAGING_BENCH_LOSS_LOG": str(loss_log),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        # Runs train side by side, several per xdist worker: each compiles Megatron's fused
        # functions with a few Inductor workers, not one per core (the code is the same).
        "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "4"),
        **(env_extra or {}),
    }
    for _attempt in range(3):
        # The probed port is free only until torchrun binds it; another worker's process can
        # take it in between. That failure happens before any training: retry on a new port.
        env["PET_MASTER_PORT"] = str(_free_port())  # torchrun reads PET_<flag> as --master-port
        for stale in tmp_path.glob(f"{loss_log.name}.rank*"):
            stale.unlink()
        result = subprocess.run(
            ["bash", str(ROOT / "examples" / "run_pretrain_1gpu.sh"), *base, *extra],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        log = result.stdout + result.stderr
        if result.returncode == 0 or not PORT_TAKEN.search(log):
            break
    assert result.returncode == 0, f"{_cause(result.returncode, log)}\n{log[-4000:]}"
    # Every rank that computes a loss (the last pipeline stage; every rank with EP) logs it:
    # one line per microbatch of the step's final result (a rerun replaces its attempt), and
    # every rank one line per step with its gradients' float64 sum ("grad <hex>").
    losses = Losses()
    for rank_file in sorted(tmp_path.glob(f"{loss_log.name}.rank*")):
        for line in rank_file.read_text().splitlines():
            first, second = line.split()
            if first == "grad":
                losses.grads.append(second)
            else:
                losses.append(first)
    return losses, log


class Losses(list):
    """Every microbatch loss (hex), with every step's gradient checksum in ``grads``."""

    def __init__(self):
        super().__init__()
        self.grads: list[str] = []


def _side_by_side(*runs):
    """Runs of ``_train`` (``partial``s) trained at once, each its own process on the GPU that
    holds them all: a test takes its longest run's time, not their sum. Results in order."""
    with ThreadPoolExecutor(max_workers=len(runs)) as threads:
        started = [threads.submit(run) for run in runs]
        return [run.result() for run in started]


def _unpaged_and_paged(tmp_path, extra=(), paged_extra=(), **common):
    """The control and the paged run of one line, side by side: ((losses, log), (losses, log))."""
    return _side_by_side(partial(_train, tmp_path, paged=False, extra=extra, **common),
                         partial(_train, tmp_path, paged=True, extra=(*extra, *paged_extra),
                                 **common))


def _report(log: str) -> dict[str, str]:
    fields = {}
    for match in REPORT.finditer(log):
        fields = dict(kv.split("=", 1) for kv in match.group(1).split())
    return fields


@pytest.fixture(scope="module")
def eager_unpaged_long(tmp_path_factory):
    """The eager unpaged control of the long runs (graphs, forced overflow), trained once."""
    losses, _ = _train(tmp_path_factory.mktemp("eager_unpaged"), paged=False, extra=EAGER_LONG)
    assert len(losses) == GRAPH_STEPS * MICROBATCHES
    return losses


def test_example_trains_paged_bitwise_equal_to_unpaged(tmp_path):
    # Holding the last layer before each backward: same losses, a pool a layer smaller.
    (unpaged, _), (paged, log), (held, held_log) = _side_by_side(
        partial(_train, tmp_path, paged=False), partial(_train, tmp_path, paged=True),
        partial(_train, tmp_path / "hold", paged=True, extra=("--paging-hold-last-slot",)))
    assert "megatron-paging installed" in log
    # DDP built on the training stream (megatron_paging/mcore/ddp_stream.py): autograd's
    # gradient accumulators run where the backward does, so PyTorch has nothing to warn about
    assert "AccumulateGrad node's stream does not match" not in log
    assert _report(log)["paging_mode"] == "paged"  # calibrated, then paged through pools
    assert len(unpaged) == 3 * MICROBATCHES
    assert all(float.fromhex(v) == float.fromhex(v) for v in unpaged)  # no NaN
    assert paged == unpaged and paged.grads == unpaged.grads and len(paged.grads) == 3
    assert held == unpaged and _report(held_log)["paging_mode"] == "paged"
    assert float(_report(held_log)["pool_cuda_mib"]) < float(_report(log)["pool_cuda_mib"])


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
    (unpaged, _), (paged, log) = _unpaged_and_paged(tmp_path, extra, nproc=2)
    assert _report(log)["paging_mode"] == "paged"
    assert unpaged and paged == unpaged and paged.grads == unpaged.grads


# -- full-iteration CUDA graphs (docs/mcore.md, "CUDA graphs") ----------------------------------


def test_example_graphed_paged_equals_graphed_unpaged_and_eager(tmp_path, eager_unpaged_long):
    counts = {"MEGATRON_PAGING_BENCH_KERNEL_COUNT_ITERS": "8,9,15"}
    (graphed_unpaged, log_u), (graphed_paged, log_p) = _side_by_side(
        partial(_train, tmp_path / "gu", paged=False, extra=GRAPHS, env_extra=counts),
        partial(_train, tmp_path / "gp", paged=True, extra=GRAPHS, env_extra=counts))
    for log in (log_u, log_p):
        assert log.count(CAPTURE_LINE) == 1  # captured once ...
    report = _report(log_p)
    # ... and replayed at every later step: the capture call and the 16 steps after it.
    assert report["graph_replays"] == str(GRAPH_STEPS - 3)
    assert report["paging_mode"] == "paged"
    assert report["overflow_actions"] == f"ok:{GRAPH_STEPS}"  # no step overflowed
    # Every replay launches the same kernels (the paging kernels included).
    paged_counts = {int(i): int(n) for i, n in KERNELS.findall(log_p)}
    unpaged_counts = {int(i): int(n) for i, n in KERNELS.findall(log_u)}
    assert len(set(paged_counts.values())) == 1 and len(paged_counts) == 3, paged_counts
    assert len(set(unpaged_counts.values())) == 1 and len(unpaged_counts) == 3, unpaged_counts
    assert graphed_paged == graphed_unpaged == eager_unpaged_long


SMALL_POOL = ("--moe-paged-stash-buffer-size-factor-cuda", "0.3")


def test_example_graphed_forced_overflow_rerun_is_bitwise_equal(tmp_path, eager_unpaged_long):
    paged, log = _train(
        tmp_path, paged=True, extra=(*GRAPHS, *SMALL_POOL, "--paging-overflow-policy", "rerun")
    )
    assert "megatron-paging: overflow at rank 0" in log and "(policy rerun: " in log
    report = _report(log)
    # The first paged step overflowed and reran eagerly in grown pools; a rerun whose pools grew
    # after the capture drops the graph, which Megatron-Core captures again.
    actions = dict(kv.split(":") for kv in report["overflow_actions"].split(","))
    assert set(actions) == {"ok", "rerun"} and int(actions["rerun"]) >= 1, actions
    assert log.count(CAPTURE_LINE) >= 1
    assert paged == eager_unpaged_long


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("policy", ["skip", "grow"])
def test_example_forced_overflow_skip_and_grow(tmp_path, policy, graphed):
    iters = GRAPHS if graphed else ("--train-iters", "8", "--no-check-for-nan-in-loss-and-grad")
    if graphed and policy == "grow":
        # One warm-up step (the calibration): the graph is captured at step 2, whose replay
        # overflows the small pool, so 'grow' must drop a captured graph. (With 3 warm-up steps
        # the growths can all land before the capture, leaving no graph to drop.)
        iters = (*iters, "--cuda-graph-warmup-steps", "1")
    paged, log = _train(
        tmp_path, paged=True, extra=(*iters, *SMALL_POOL, "--paging-overflow-policy", policy)
    )
    actions = dict(kv.split(":") for kv in _report(log)["overflow_actions"].split(","))
    assert f"(policy {policy}: " in log and int(actions[policy]) >= 1
    # the report's overflow records: where, rows needed vs held, and the factor that fits
    records = json.loads(_report(log)["overflow"])
    assert len(records) == int(actions[policy]) and all(r["policy"] == policy for r in records)
    for record in records:
        assert record["flag"] == "--moe-paged-stash-buffer-size-factor-cuda"
        assert record["rows_needed"] > record["rows_held"] and record["factor"] > 0.3
    assert all(float.fromhex(v) == float.fromhex(v) for v in paged)  # nothing became NaN
    if policy == "skip":
        assert int(actions["skip"]) == len(paged) // MICROBATCHES - 1  # all but calibration
        if graphed:
            assert log.count(CAPTURE_LINE) == 1
    else:
        assert "grew pool" in log
        # 'grow' sizes the pools from what the step needed (+10%): later steps fit, unless
        # the routing of one needs more still.
        assert int(actions["grow"]) < 5 and int(actions["ok"]) >= 1
        if graphed:
            # A growth after the capture dropped the graph, captured again after warm-up (into a
            # new graph pool); growths during the warm-up steps had no graph to drop.
            dropped = int(_report(log)["graphs_dropped"])
            assert 1 <= dropped <= int(actions["grow"])
            assert log.count(CAPTURE_LINE) == dropped + 1


def test_example_skipped_steps_need_no_more_memory_than_a_sized_pool(tmp_path):
    """A pool far too small with 'skip' drops every paged step; its whole-step peak must stay at
    or below that of a run whose pool fits (the dropped step takes no optimizer step, so nothing
    beyond the smaller pool is allocated)."""
    iters = ("--train-iters", "6", "--no-check-for-nan-in-loss-and-grad")
    (_, sized_log), (_, skip_log) = _side_by_side(
        partial(_train, tmp_path / "sized", paged=True, extra=iters),
        partial(_train, tmp_path / "skip", paged=True,
                extra=(*iters, "--moe-paged-stash-buffer-size-factor-cuda", "0.05",
                       "--paging-overflow-policy", "skip")))
    sized, skipped = _report(sized_log), _report(skip_log)
    assert sized["overflow_actions"] == "ok:6"
    assert "skip" in skipped["overflow_actions"]
    assert float(skipped["pool_cuda_mib"]) < float(sized["pool_cuda_mib"])
    for field in ("steady_peak_allocated_mib", "peak_allocated_mib"):
        assert float(skipped[field]) <= float(sized[field]) + 1.0, (field, sized, skipped)


def test_example_forced_overflow_rerun_is_bitwise_equal_to_unpaged(tmp_path):
    (unpaged, _), (paged, log) = _unpaged_and_paged(
        tmp_path, paged_extra=(*SMALL_POOL, "--paging-overflow-policy", "rerun"))
    assert "megatron-paging: overflow at rank 0" in log and "(policy rerun: " in log
    # Each step logs its final result (the rerun's), so the whole run equals the control.
    assert paged == unpaged


# -- fine-grained activation offloading (docs/offload.md) --------------------------------------

EXPERT_MODULES = ("expert_fc1", "moe_act")
DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


def _offloading(backend: str, modules: tuple[str, ...]) -> tuple[str, ...]:
    # The small model's tensors are far below Megatron's 1M-element default threshold.
    return ("--fine-grained-activation-offloading", "--offload-modules", *modules,
            "--paging-offload-backend", backend, "--min-offloaded-tensor-size", "1024")


@pytest.fixture(scope="module")
def eager_unpaged_short(tmp_path_factory):
    """The unpaged control of the short (3-step) offloading runs, trained once."""
    losses, _ = _train(tmp_path_factory.mktemp("unpaged_short"), paged=False)
    assert len(losses) == 3 * MICROBATCHES
    return losses


# More than one hardware queue: offloaded live rows go by the copy engine's prefix.
DMA_PREFIX = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
RECOMPUTE_FC1 = ("--paging-recompute-expert-fc1",)


@pytest.mark.parametrize(
    ("backend", "modules", "stash", "more", "env"),
    [
        pytest.param("paged", EXPERT_MODULES, False, (), {}, id="paged-experts"),
        pytest.param("paged", EXPERT_MODULES, False, (), DMA_PREFIX,
                     id="paged-experts+dma-prefix"),
        pytest.param("paged", DENSE_MODULES, False, (), {}, id="paged-dense"),
        pytest.param("paged", DENSE_MODULES + EXPERT_MODULES, False, (), {}, id="paged-both"),
        pytest.param("paged", DENSE_MODULES + EXPERT_MODULES, True, (), {},
                     id="paged-both+stash"),
        pytest.param("paged", DENSE_MODULES + EXPERT_MODULES, True, (), DMA_PREFIX,
                     id="paged-both+stash+dma-prefix"),
        pytest.param("paged", DENSE_MODULES + ("moe_act",), True, (), {},
                     id="paged-dense+moe_act+stash"),
        pytest.param("mcore", DENSE_MODULES + EXPERT_MODULES, False, (), {}, id="mcore-both"),
        # the experts save only x and recompute fc1: expert_fc1 is their one offload group
        pytest.param("paged", ("expert_fc1",), False, RECOMPUTE_FC1, DMA_PREFIX,
                     id="paged-expert_fc1+recompute-fc1+dma-prefix"),
        pytest.param("paged", DENSE_MODULES + ("expert_fc1",), True, RECOMPUTE_FC1, {},
                     id="paged-dense+expert_fc1+recompute-fc1+stash"),
    ],
)
def test_example_offloading_is_bitwise_equal_to_no_offloading(
    tmp_path, eager_unpaged_short, backend, modules, stash, more, env
):
    losses, log = _train(tmp_path, paged=stash, extra=(*_offloading(backend, modules), *more),
                         env_extra=env)
    report = _report(log)
    assert float(report["offload_host_mib"]) > 0 or backend == "mcore"
    if backend == "paged":
        assert report["paging_mode"] == "paged"
        if "expert_fc1" in modules:  # only live rows crossed, never more than the capacity
            live, capacity = (float(report[k]) for k in
                              ("offload_rows_live_mib", "offload_rows_capacity_mib"))
            assert 0 < live <= capacity
        if env:  # the copy engine's prefix arena was sized and used
            assert "DMA prefix rows" in log
    assert losses == eager_unpaged_short


def test_example_paged_stash_with_recomputed_fc1_equals_unpaged(tmp_path, eager_unpaged_short):
    """The experts save x only (one pool instead of two) and recompute fc1: same losses as the
    unpaged control whose experts save fc1."""
    losses, log = _train(tmp_path, paged=True, extra=RECOMPUTE_FC1)
    assert _report(log)["paging_mode"] == "paged"
    assert losses == eager_unpaged_short


@pytest.mark.parametrize("env", [{}, DMA_PREFIX], ids=["kernels", "dma-prefix"])
def test_example_graphed_offloading_equals_eager_unpaged(tmp_path, eager_unpaged_long, env):
    extra = (*GRAPHS, *_offloading("paged", DENSE_MODULES + ("moe_act",)))
    losses, log = _train(tmp_path, paged=True, extra=extra, env_extra=env)
    assert log.count(CAPTURE_LINE) == 1
    report = _report(log)
    assert report["graph_replays"] == str(GRAPH_STEPS - 3)
    assert report["overflow_actions"] == f"ok:{GRAPH_STEPS}"
    assert losses == eager_unpaged_long
