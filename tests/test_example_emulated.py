"""GPU: one rank of a larger job under Megatron's ``--fake-process-group`` (emulated EP and PP
peers, docs/scale.md): Megatron-Core's pipeline schedules run for real on the emulated rank, and
paged and unpaged runs give bitwise equal losses (on the stage with the loss) and gradient
checksums (on every stage), overflowing steps included: 'rerun' equals the unpaged run, 'skip'
and 'grow' equal an unpaged run that drops the same updates; two runs with one seed are
identical, peaks included."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from test_example_pretrain import SMALL, _report, _side_by_side, _train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.training_run,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# 16 ranks: PP 2 x EP 8 (DP 8); 16 experts, 2 per rank; 4 microbatches per step.
LAYOUT = (
    "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
    "--num-experts", "16", "--num-layers", "4", "--global-batch-size", "32",
    "--use-distributed-optimizer", "--fake-process-group", "--train-iters", "4",
)  # fmt: skip
WORLD = {"WORLD_SIZE": "16"}
STAGE_0, STAGE_1 = {**WORLD, "RANK": "0"}, {**WORLD, "RANK": "8"}
INTERLEAVED = ("--num-virtual-stages-per-pipeline-rank", "2")
# DeepSeek-V3's shape of layer, small: MLA, two dense layers first, a shared expert, qk norms
MLA = (
    "--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32",
    "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64",
    "--kv-channels", "64", "--qk-layernorm", "--moe-layer-freq", "([0]*2+[1]*2)",
    "--moe-shared-expert-intermediate-size", "256",
)  # fmt: skip


def _pair(tmp_path, env, extra=(), paged_extra=(), beside=()):
    """The unpaged and the paged run, trained at once with any further runs ``beside``
    (``partial``s of ``_train``), whose results come last."""
    (unpaged, log_u), (paged, log_p), *more = _side_by_side(
        partial(_train, tmp_path / "u", paged=False, extra=(*LAYOUT, *extra), env_extra=env),
        partial(_train, tmp_path / "p", paged=True, extra=(*LAYOUT, *extra, *paged_extra),
                env_extra=env),
        *beside)
    for log in (log_u, log_p):
        assert "emulated" in _report(log)["peers"]
    assert float(_report(log_p)["pool_cuda_mib"]) > 0  # calibrated, then paged through pools
    assert len(paged.grads) == 4
    return (unpaged, paged, log_p, *more)


def _actions(log: str) -> dict[str, int]:
    return {k: int(v) for k, v in
            (kv.split(":") for kv in _report(log)["overflow_actions"].split(","))}


POOL = "--moe-paged-stash-buffer-size-factor-cuda"
POLICY = "--paging-overflow-policy"


def _without_global_batch(flags) -> tuple[str, ...]:
    """Megatron refuses --global-batch-size beside --step-batch-size-schedule."""
    flags = list(flags)
    at = flags.index("--global-batch-size")
    return tuple(flags[:at] + flags[at + 2:])


# A growing batch: 8, 16, then 32 samples from step 3 on (thresholds in tokens, 256 a sample):
# 1, 2, then 4 microbatches per step (DP 8)
SCHEDULE_BASE = _without_global_batch(SMALL)
SCHEDULE_LAYOUT = (*_without_global_batch(LAYOUT), "--step-batch-size-schedule",
                   "0:8 2048:16 6144:32", "--train-iters", "6")


def test_emulated_first_stage_1f1b_pages_bitwise(tmp_path):
    """Stage 0 of a 1F1B pipeline (no loss there): gradient checksums bitwise, with the
    example's pool (steps that overflow are rerun) and with one that never overflows."""
    roomy_run = partial(_train, tmp_path / "roomy", paged=True, extra=(*LAYOUT, POOL, "3.0"),
                        env_extra=STAGE_0)
    unpaged, paged, log, (roomy, roomy_log) = _pair(tmp_path, STAGE_0, beside=(roomy_run,))
    assert not unpaged and not paged  # no loss on the first stage
    assert len(paged.grads) == 4 and paged.grads == unpaged.grads
    report = _report(log)
    assert int(report["peer_rows"]) > 0 and float(report["pool_cuda_mib"]) > 0
    assert _actions(roomy_log) == {"ok": 4} and roomy.grads == unpaged.grads


@pytest.mark.parametrize("stage", [STAGE_0, STAGE_1], ids=["first", "last"])
def test_emulated_forced_overflow_rerun_is_bitwise_equal_to_unpaged(tmp_path, stage):
    """A pool far too small: the first paged step overflows and runs again in pools grown to
    what it needed, paged (no unpaged pass); losses and gradients are the unpaged run's, bit
    for bit."""
    unpaged, paged, log = _pair(tmp_path, stage, paged_extra=(POOL, "0.3", POLICY, "rerun"))
    actions = _actions(log)
    assert actions.get("rerun", 0) >= 1 and actions.get("ok", 0) + actions["rerun"] == 4, actions
    assert "re-running it without paging" not in log  # the grown pools held every rerun
    assert paged == unpaged and paged.grads == unpaged.grads


def test_emulated_over_budget_steps_rerun_paged_bitwise_equal_to_unpaged(tmp_path):
    """A static budget of exactly the average (capacity factor 1): steps whose routing sends a
    destination more than its share are over the budget and run again without it, paged
    through the pools as they are (a roomy pool: no unpaged pass), equal to the unpaged run
    (which reruns them unpaged) bit for bit."""
    budget = ("--moe-expert-rank-capacity-factor", "1.0")
    unpaged, paged, log = _pair(tmp_path, STAGE_1, extra=budget, paged_extra=(POOL, "3.0"))
    assert "over the static budget" in log and _actions(log).get("rerun", 0) >= 1, log[-3000:]
    assert "re-running it without paging" not in log  # the budget-less rerun stayed paged
    assert paged == unpaged and paged.grads == unpaged.grads


@pytest.mark.parametrize("policy", ["skip", "grow"])
def test_emulated_skip_and_grow_equal_unpaged_with_the_same_updates_dropped(tmp_path, policy):
    """'skip' and 'grow' drop an overflowing step's update: every step they keep equals an
    unpaged run that drops the same updates (MEGATRON_PAGING_BENCH_DROP_ITERS), losses and
    gradients bitwise; the dropped steps' own gradients come from pages never written."""
    extra = (*LAYOUT, POOL, "0.5", POLICY, policy)
    paged, log = _train(tmp_path / "p", paged=True, extra=extra, env_extra=STAGE_1)
    dropped = sorted({r["step"] for r in json.loads(_report(log)["overflow"])})
    assert dropped and _actions(log)[policy] == len(dropped)
    drop = {**STAGE_1, "MEGATRON_PAGING_BENCH_DROP_ITERS": ",".join(map(str, dropped))}
    unpaged, log_u = _train(tmp_path / "u", paged=False, extra=LAYOUT, env_extra=drop)
    assert _actions(log_u) == {"ok": 4}
    kept = [i for i in range(4) if i + 1 not in dropped]
    assert [paged.grads[i] for i in kept] == [unpaged.grads[i] for i in kept]
    assert paged == unpaged  # forward losses never read a page


def test_emulated_last_stage_interleaved_mla_pages_bitwise_and_repeats(tmp_path):
    """The loss stage of an interleaved schedule, MLA layers, a dense/MoE pattern: losses and
    gradients bitwise; a second paged run with the same seed repeats every loss, gradient and
    per-iteration peak."""
    again_run = partial(_train, tmp_path / "again", paged=True,
                        extra=(*LAYOUT, *INTERLEAVED, *MLA), env_extra=STAGE_1)
    unpaged, paged, log, (again, log_again) = _pair(tmp_path, STAGE_1, (*INTERLEAVED, *MLA),
                                                    beside=(again_run,))
    assert len(paged) == 4 * 4 and paged == unpaged and paged.grads == unpaged.grads
    assert again == paged and again.grads == paged.grads
    peaks = [line for line in log.splitlines() if "step-memory" in line]
    peaks_again = [line for line in log_again.splitlines() if "step-memory" in line]
    strip = [" ".join(p for p in line.split() if not p.startswith("host_")) for line in peaks]
    strip_again = [" ".join(p for p in line.split() if not p.startswith("host_"))
                   for line in peaks_again]
    assert strip and strip == strip_again


@pytest.mark.parametrize("stage", [STAGE_0, STAGE_1], ids=["first", "last"])
def test_emulated_combined_1f1b_pages_bitwise(tmp_path, stage):
    """Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``: each layer split
    into schedule nodes on detached inputs, EP exchanges overlapped with another microbatch's
    compute) on the interleaved schedule: paged = unpaged bitwise, losses and gradients."""
    extra = (*INTERLEAVED, "--overlap-moe-expert-parallel-comm")
    unpaged, paged, _ = _pair(tmp_path, stage, extra)
    assert len(paged.grads) == 4 and paged == unpaged and paged.grads == unpaged.grads


def test_emulated_batch_schedule_calibrates_again_while_the_pipeline_fills(tmp_path):
    """``--step-batch-size-schedule`` on stage 0 of PP 2: a step of one microbatch keeps one
    alive, the later steps two. Pools calibrated at step 1 would overflow on every later step
    (under 'skip' every update after the ramp would be dropped); the runner drops them when
    the count grows, so steps 2 and 3 calibrate again and keep their updates, and every kept
    step equals an unpaged run that drops the same updates, bit for bit."""
    paged, log = _train(tmp_path / "p", paged=True, extra=(*SCHEDULE_LAYOUT, POLICY, "skip"),
                        env_extra=STAGE_0, base=SCHEDULE_BASE)
    report = _report(log)
    paging_lines = [line for line in log.splitlines() if "paging" in line or "microbatch" in line]
    assert int(report["pools_recalibrated"]) == 2, "\n".join(paging_lines[-40:])
    dropped = sorted({r["step"] for r in json.loads(report["overflow"])})
    assert not {1, 2, 3} & set(dropped), dropped  # calibration steps page nothing
    drop = {**STAGE_0, "MEGATRON_PAGING_BENCH_DROP_ITERS": ",".join(map(str, dropped))}
    unpaged, _ = _train(tmp_path / "u", paged=False, extra=SCHEDULE_LAYOUT, env_extra=drop,
                        base=SCHEDULE_BASE)
    assert len(paged.grads) == len(unpaged.grads) == 6
    kept = [i for i in range(6) if i + 1 not in dropped]
    assert [paged.grads[i] for i in kept] == [unpaged.grads[i] for i in kept]
