"""One rank's compute-op order from the real schedule generators, without a process group.

* :func:`one_f_one_b` / :func:`interleaved_one_f_one_b` — Megatron-Core 0.19.2's
  ``get_pp_rank_microbatches`` (warmup count) and ``get_schedule_table`` (virtual microbatch ->
  (microbatch, chunk)), laid out the way ``forward_backward_pipelining_with_interleaving`` runs
  them: warmup forwards, then one forward + one backward per step, then cooldown backwards. The
  backward of virtual microbatch ``k`` runs chunk ``num_chunks - 1 - chunk(k)``.
  ``combined_1f1b=True`` is ``overlap_moe_expert_parallel_comm``: one more warmup forward, and
  each steady-state forward runs layer-interleaved with its backward.
  ``delay_wgrad=True`` is ``--delay-wgrad-compute``: each backward defers its weight gradient
  to a ``W`` op that follows it.
* :func:`dualpipev` — PyTorch's ``ScheduleDualPipeV._calculate_single_rank_operations``, which
  only needs the pipeline size and microbatch count, so it is called on a stand-in ``self``.
  ``I`` (input-only backward) becomes ``B`` with ``defers_wgrad``; overlapped F/B pairs become an
  ``F`` with ``overlap`` followed by its ``B``.

The pipeline rank and sizes are plain arguments: a duck-typed communicator answers
``get_pp_rank_microbatches``' questions.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megatron_paging.runtime.pipeline_ops import Op, check_ops


def _check(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _communicator(pp: int, rank: int, vpp: int | None) -> SimpleNamespace:
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)


def _megatron_order(
    pp: int,
    rank: int,
    microbatches: int,
    vpp: int | None,
    group_size: int,
    combined_1f1b: bool,
    delay_wgrad: bool,
) -> list[Op]:
    chunks = vpp or 1
    total, _, warmup, remaining = get_pp_rank_microbatches(
        microbatches,
        chunks,
        group_size,
        overlap_moe_expert_parallel_comm=combined_1f1b,
        p2p_communicator=_communicator(pp, rank, vpp),
    )
    table = get_schedule_table(microbatches, chunks, group_size)

    def forward(k: int, overlap: bool = False) -> list[Op]:
        microbatch, chunk = table[k]
        return [Op("F", chunk, microbatch, overlap=overlap)]

    def backward(k: int) -> list[Op]:
        microbatch, chunk = table[k]
        chunk = chunks - 1 - chunk
        if not delay_wgrad:
            return [Op("B", chunk, microbatch)]
        return [Op("B", chunk, microbatch, defers_wgrad=True), Op("W", chunk, microbatch)]

    ops: list[Op] = []
    for k in range(warmup):
        ops += forward(k)
    for j in range(remaining):
        step_backward = backward(j)
        ops += forward(warmup + j, overlap=combined_1f1b) + step_backward
    for j in range(remaining, total):
        ops += backward(j)
    check_ops(ops)
    return ops


def one_f_one_b(pp: int, rank: int, microbatches: int, delay_wgrad: bool = False) -> list[Op]:
    """Megatron-Core's non-interleaved 1F1B order for pipeline rank ``rank`` of ``pp``."""
    _check("pp", pp, 1)
    _check("microbatches", microbatches, 1)
    if not 0 <= _check("rank", rank, 0) < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    return _megatron_order(pp, rank, microbatches, None, microbatches, False, delay_wgrad)


def interleaved_one_f_one_b(
    pp: int,
    vpp: int,
    rank: int,
    microbatches: int,
    group_size: int | None = None,
    combined_1f1b: bool = False,
    delay_wgrad: bool = False,
) -> list[Op]:
    """Megatron-Core's interleaved 1F1B order (``vpp`` chunks per rank) for ``rank``.

    ``group_size`` is ``microbatch_group_size_per_vp_stage`` (default ``pp``, as in Megatron).
    """
    _check("pp", pp, 2)
    _check("vpp", vpp, 2)
    _check("microbatches", microbatches, 1)
    if not 0 <= _check("rank", rank, 0) < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    group_size = pp if group_size is None else group_size
    if not pp <= group_size <= microbatches:
        raise ValueError(
            f"group_size (microbatch_group_size_per_vp_stage) must be in [pp={pp}, "
            f"microbatches={microbatches}], got {group_size}"
        )
    if 0 < microbatches % group_size < pp:
        raise ValueError(
            f"microbatches % group_size must be 0 or >= pp (Megatron-Core's rule), got "
            f"{microbatches} % {group_size} = {microbatches % group_size}"
        )
    return _megatron_order(pp, rank, microbatches, vpp, group_size, combined_1f1b, delay_wgrad)


def dualpipev(pp: int, rank: int, microbatches: int) -> list[Op]:
    """PyTorch's DualPipeV per-rank order (two chunks per rank: 0 = first leg of the V)."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    _check("pp", pp, 1)
    if not 0 <= _check("rank", rank, 0) < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    if _check("microbatches", microbatches, 1) < 2 * pp:
        raise ValueError(f"DualPipeV needs microbatches >= 2 * pp = {2 * pp}, got {microbatches}")
    stand_in = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches)
    actions = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(stand_in, rank)
    stage0, stage1 = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")[rank]
    chunk_of = {stage0: 0, stage1: 1}
    kinds = torch_schedules._ComputationType

    def convert(action, overlap=False) -> Op:
        chunk, mb = chunk_of[action.stage_index], action.microbatch_index
        kind = action.computation_type
        if kind == kinds.FORWARD:
            return Op("F", chunk, mb, overlap=overlap)
        if kind == kinds.FULL_BACKWARD:
            return Op("B", chunk, mb)
        if kind == kinds.BACKWARD_INPUT:
            return Op("B", chunk, mb, defers_wgrad=True)
        if kind == kinds.BACKWARD_WEIGHT:
            return Op("W", chunk, mb)
        raise ValueError(f"unexpected DualPipeV action {action!r}")

    ops: list[Op] = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type == kinds.OVERLAP_F_B:
            forward, backward = action.sub_actions
            ops += [convert(forward, overlap=True), convert(backward)]
        else:
            ops.append(convert(action))
    check_ops(ops)
    return ops


SCHEDULES = ("1f1b", "interleaved", "dualpipev")


def schedule_ops(
    schedule: str, pp: int, microbatches: int, rank: int = 0, vpp: int = 2, **options
) -> tuple[list[Op], int]:
    """``(ops, chunks per rank)`` for a schedule name in :data:`SCHEDULES` (CLI helper)."""
    if schedule == "1f1b":
        return one_f_one_b(pp, rank, microbatches, **options), 1
    if schedule == "interleaved":
        return interleaved_one_f_one_b(pp, vpp, rank, microbatches, **options), vpp
    if schedule == "dualpipev":
        return dualpipev(pp, rank, microbatches), 2
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


__all__ = ["SCHEDULES", "dualpipev", "interleaved_one_f_one_b", "one_f_one_b", "schedule_ops"]
