"""Which ops and pipeline stages the demo's rank runs: the schedule flags, checked, turned into
the rank's op order (Megatron-Core's 1F1B / interleaved 1F1B generators, PyTorch's DualPipeV)
and the global stage of each of its model chunks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_paging.demo.quiet import quiet_megatron
from megatron_paging.runtime.pipeline_ops import Op

with quiet_megatron():
    from megatron_paging.mcore.op_order import schedule_ops

SCHEDULES = ("none", "1f1b", "interleaved", "dualpipev")


@dataclass(frozen=True)
class Layout:
    schedule: str
    pp: int
    vpp: int | None
    rank: int
    microbatches: int
    ops: list[Op]
    stages: list[int]  # global stage of each chunk
    num_stages: int


def stage_indices(schedule: str, pp: int, rank: int, chunks: int) -> list[int]:
    """Global pipeline stage of each of ``rank``'s chunks (interleaved: round robin; V: mirror)."""
    if schedule == "interleaved":
        return [c * pp + rank for c in range(chunks)]
    if schedule == "dualpipev":
        return [rank, 2 * pp - 1 - rank]
    return [rank]


def _checked(args: argparse.Namespace) -> tuple[int, int | None, int]:
    """``(pp, vpp, rank)`` with their defaults; ValueError naming the flag of a bad combination."""
    schedule, microbatches = args.schedule, args.microbatches
    if args.vpp is not None and schedule != "interleaved":
        raise ValueError(f"--vpp applies only to --schedule interleaved, not {schedule}")
    if schedule == "none" and args.pp not in (None, 1):
        raise ValueError(f"--pp must be 1 with --schedule none (one stage), got {args.pp}")
    pp = (1 if schedule == "none" else 2) if args.pp is None else args.pp
    rank = args.rank
    if rank is None:  # the rank holding the last stage: the table then shows the loss
        rank = 0 if schedule in ("none", "dualpipev") else pp - 1
    if rank >= pp:
        raise ValueError(f"--rank must be < --pp ({pp}), got {rank}")
    vpp = None
    if schedule == "interleaved":
        vpp = 2 if args.vpp is None else args.vpp
        if pp < 2:
            raise ValueError(f"--pp must be >= 2 with --schedule interleaved, got {pp}")
        if vpp < 2:
            raise ValueError(f"--vpp must be >= 2 with --schedule interleaved, got {vpp}")
        if microbatches % pp:
            raise ValueError(
                f"--microbatches must be a multiple of --pp ({pp}) with --schedule "
                f"interleaved, got {microbatches}"
            )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(
            f"--microbatches must be >= 2 x --pp ({2 * pp}) with --schedule dualpipev, "
            f"got {microbatches}"
        )
    return pp, vpp, rank


def resolve_layout(args: argparse.Namespace) -> Layout:
    """The rank's op order and stages; raises ValueError naming the flag for a bad combination."""
    schedule, microbatches = args.schedule, args.microbatches
    pp, vpp, rank = _checked(args)
    if schedule == "none":
        ops, chunks = [Op(kind, 0, m) for m in range(microbatches) for kind in "FB"], 1
    else:
        ops, chunks = schedule_ops(schedule, pp, microbatches, rank, vpp or 2)
    num_stages = {"interleaved": pp * chunks, "dualpipev": 2 * pp}.get(schedule, pp)
    stages = stage_indices(schedule, pp, rank, chunks)
    return Layout(schedule, pp, vpp, rank, microbatches, ops, stages, num_stages)


__all__ = ["SCHEDULES", "Layout", "resolve_layout", "stage_indices"]
