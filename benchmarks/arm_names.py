"""The benchmarks' arm names: the plan's arm (``megatron_paging.plan.arms.ARM_NAMES``), then,
for a run that changes something beside it, a variant after a dot: ``paged.hold`` is the paged
arm with ``--paging-hold-last-slot``. The plan's arm names which memory model describes the run
(and which arm ``megatron-paging plan`` predicts for it); the variant names what differs.

Result files written before this naming used other names: a reader that loads such a file (one
without ``"arm_naming"``, :func:`named_by_plan`) renames its arms with :func:`current_name`. New
runs are always named with :func:`arm_name`, never through the old names.
"""

from __future__ import annotations

from megatron_paging.plan.arms import ARM_NAMES

SEPARATOR = "."
# Written into every result file whose arms follow this naming.
NAMING_KEY, NAMING = "arm_naming", "plan_arm[.variant]"

# Old name -> name, per benchmark, for reading result files that lack NAMING_KEY. A frontier
# file's ``paged_offload`` was the experts' live-row offload without the stash; a scale file's
# was the same offload with the stash, the plan's ``paged_offload_experts``. ``*_dma*``: the
# same runs with CUDA_DEVICE_MAX_CONNECTIONS > 1, under an earlier name.
OLD_NAMES = {
    "frontier": {
        "unpaged_unfused": "unpaged.unfused",
        "paged_hold": "paged.hold",
        "mcore_manager": "mcore",
        "recompute_moe": "recompute",
        "paged_recompute_core_attn": "paged.recompute_core_attn",
        "mcore_offload": "offload",
        "paged_offload": "paged_offload_experts.no_stash",
        "paged_offload_dma": "paged_offload_experts.no_stash",
        "paged_stash_plus_offload": "paged_offload",
        "unpaged_recompute_fc1": "unpaged.recompute_fc1",
        "paged_recompute_fc1_hold": "paged_recompute_fc1.hold",
        "paged_recompute_fc1_tight": "paged_recompute_fc1.tight",
        "paged_recompute_fc1_spill": "paged_recompute_fc1.spill",
        "paged_offload_recompute_fc1": "paged_offload_experts.recompute_fc1_no_stash",
        "paged_offload_dma_recompute_fc1": "paged_offload_experts.recompute_fc1_no_stash",
    },
    "scale": {
        "mcore_manager": "mcore",
        "mcore_offload": "offload",
        "paged_offload": "paged_offload_experts",
        "unpaged_deterministic": "unpaged.deterministic",
        "paged_deterministic": "paged.deterministic",
    },
}


def arm_name(plan_arm: str, variant: str = "") -> str:
    """``plan_arm`` (one of the plan's arms), with ``.variant`` when there is one."""
    if plan_arm not in ARM_NAMES:
        raise ValueError(f"{plan_arm!r} is not an arm of the plan ({', '.join(ARM_NAMES)})")
    if SEPARATOR in variant:
        raise ValueError(f"variant {variant!r} contains {SEPARATOR!r}")
    return f"{plan_arm}{SEPARATOR}{variant}" if variant else plan_arm


def split_name(name: str) -> tuple[str, str]:
    """(plan arm, variant) of an arm name; the variant is "" for a plan arm itself."""
    plan_arm, _, variant = name.partition(SEPARATOR)
    return plan_arm, variant


def plan_arm_of(name: str) -> str:
    return split_name(name)[0]


def named_by_plan(data: dict) -> bool:
    """Whether a loaded result file names its arms this way (else: :func:`current_name`)."""
    return data.get(NAMING_KEY) == NAMING


def current_name(name: str, benchmark: str) -> str:
    """The name of an arm that a result file without :data:`NAMING_KEY` calls ``name`` (names
    of settings no longer offered stay as they are)."""
    return OLD_NAMES[benchmark].get(name, name)


__all__ = ["NAMING", "NAMING_KEY", "OLD_NAMES", "SEPARATOR", "arm_name", "current_name",
           "named_by_plan", "plan_arm_of", "split_name"]
