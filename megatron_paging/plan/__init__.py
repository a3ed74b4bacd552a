"""``megatron-paging plan``: each arm's per-rank memory predicted from a launch line, before
launch, and the page pools sized for a target overflow rate (docs/plan.md).

Pure Python (no Megatron): :mod:`megatron_paging.mcore.plan_inputs` reads a launch line through
Megatron's own parser and functions into :class:`PlanInputs`, and
:mod:`megatron_paging.mcore.plan_cli` is the command. Here: :mod:`.shapes` (tensor shapes),
:mod:`.liveness` (what is alive op by op), :mod:`.arms` (one arm on one rank), :mod:`.pools`
(pool sizes and the Monte-Carlo), :mod:`.model` (the plan of one rank), :mod:`.report` (table,
JSON, PNG). Prediction against measured runs lives with the benchmarks
(benchmarks/plan_validation.py).
"""

from megatron_paging.plan.arms import ARMS, CONSTANTS, ArmMemory
from megatron_paging.plan.model import Plan, PlanInputs, StageInputs, build_plan
from megatron_paging.plan.report import format_table, to_dict, to_json

__all__ = ["ARMS", "CONSTANTS", "ArmMemory", "Plan", "PlanInputs", "StageInputs", "build_plan",
           "format_table", "to_dict", "to_json"]
