"""``megatron-paging plan``: each arm's per-rank memory predicted from a launch line, before
launch, and the page pools sized for a target overflow rate (docs/plan.md).

Pure Python but for :mod:`.adapter`, which reads a Megatron launch line through Megatron's own
parser and functions: :mod:`.shapes` (tensor shapes), :mod:`.liveness` (what is alive op by
op), :mod:`.arms` (one arm on one rank), :mod:`.pools` (pool sizes and the Monte-Carlo),
:mod:`.model` (the plan of one rank), :mod:`.report` (table, JSON, PNG). Prediction against
measured runs lives with the benchmarks (benchmarks/plan_validation.py).
"""

from megatron_paging.plan.arms import ARMS, CONSTANTS, ArmMemory
from megatron_paging.plan.model import Plan, PlanInputs, StageInputs, build_plan
from megatron_paging.plan.report import format_table, to_dict, to_json


def plan_from_argv(argv, world_size=None, rank=None, **build):
    """Plan a Megatron launch line (imports Megatron; see :mod:`.adapter`)."""
    from megatron_paging.plan.adapter import plan_from_argv as from_argv

    return from_argv(argv, world_size, rank, **build)


__all__ = ["ARMS", "CONSTANTS", "ArmMemory", "Plan", "PlanInputs", "StageInputs", "build_plan",
           "format_table", "plan_from_argv", "to_dict", "to_json"]
