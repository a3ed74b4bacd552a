"""What a step that must be discarded does: one :class:`OverflowPolicy` type, three policies.

``--paging-overflow-policy`` names one of :data:`POLICIES`; the config
(:class:`megatron_paging.config.PagingConfig`) builds the policy object from that name once,
where the flags are validated, and every driver hands that object to its
:class:`~megatron_paging.overflow.monitor.OverflowMonitor`.

A policy says *when* the host may read the step's flags (``reads_before_optimizer``: the rerun
policy must replace the gradients before the optimizer consumes them, as Megatron-Core does; the
others read after the step, whose update was already dropped on the device through
:mod:`megatron_paging.overflow.optimizer_skip`) and *what* to do with a step to discard
(:meth:`OverflowPolicy.on_discard`), through the driver's :class:`StepControl`. A new policy is
one class here, listed in :data:`POLICIES`, and one name in the flag's choices
(``OverflowPolicyName`` in :mod:`megatron_paging.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from megatron_paging.overflow.demand import OverflowReport

# How much ``grow`` enlarges a tier whose step's need was not counted (demand.grown_pages).
GROWTH_FACTOR = 1.5


@dataclass(frozen=True)
class StepFlags:
    """Per-flag count of ranks that raised it during one step (after the all_reduce), and this
    rank's own demand counts (demand.py; not reduced, not compared)."""

    overflow_ranks: int = 0
    host_spill_ranks: int = 0
    invalid_live_ranks: int = 0
    over_budget_ranks: int = 0
    demand: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def discard(self) -> bool:
        """The step's gradients are wrong: its optimizer update must not be applied."""
        return bool(self.overflow_ranks or self.invalid_live_ranks or self.over_budget_ranks)


class StepControl(Protocol):
    """What a training driver lets a policy do about the step it just ran."""

    def rerun(self, paged: bool) -> None:
        """Repeat the step's forward-backward (same data, same random draws) before the
        optimizer step: through the pools as they are now (``paged``), or without paging."""

    def grow_pools(self, factor: float) -> bool:
        """Enlarge the pools for the next step: each tier that fell short to what the step
        needed (demand.py), by ``factor`` where that was not counted. False: the driver has no
        pools of its own to grow (Megatron-Core's manager)."""


@dataclass(frozen=True)
class OverflowPolicy:
    """Base class: what happens after a step whose flags say it must be discarded. A policy is a
    value (frozen, equal to another of its class with the same options), like the config that
    holds it."""

    name: ClassVar[str]
    reads_before_optimizer: ClassVar[bool]

    def outcome(self, report: OverflowReport | None) -> str:
        """What happens to the step, for the overflow line (``report``: this rank's)."""
        return "step discarded"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        """Act on a step to discard; returns the action taken ('rerun', 'skip', 'grow')."""
        raise NotImplementedError


@dataclass(frozen=True)
class RerunPolicy(OverflowPolicy):
    """Repeat the step before the optimizer step, so that no update is lost.

    A step whose pools fell short runs again *paged*, after each tier that overflowed grew to
    what the step needed (its demand was counted, so the same data fits): the rerun needs the
    step's own page demand, not the unpaged peak (Megatron-Core reruns unpaged, which cannot
    fit where paging is what makes a rank fit). A step whose dispatcher was over its static
    budget runs again without the budget, paged through the pools as they are (its dropped
    rows were never counted, and growing the pools by a guess at every such step would only
    ratchet memory up). A paged rerun that overflows runs once more unpaged (the monitor)."""

    name = "rerun"
    reads_before_optimizer = True
    growth_factor: float = GROWTH_FACTOR  # for a tier whose need was not counted

    def outcome(self, report: OverflowReport | None) -> str:
        if report is None:
            return "step re-run in grown pools"
        return f"step re-run, the {report.tier} tier grown to {report.grown_rows:,} rows"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        if flags.overflow_ranks:
            step.rerun(paged=step.grow_pools(self.growth_factor))
        else:
            step.rerun(paged=bool(flags.over_budget_ranks))
        return "rerun"


@dataclass(frozen=True)
class SkipPolicy(OverflowPolicy):
    """Drop the step, like a loss-scale overflow (already done on the device)."""

    name = "skip"
    reads_before_optimizer = False

    def outcome(self, report: OverflowReport | None) -> str:
        return "update skipped"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        return "skip"


@dataclass(frozen=True)
class GrowPolicy(OverflowPolicy):
    """Drop the step, then size each tier that overflowed for the next one from what the step
    needed (demand.grown_pages); ``growth_factor`` only where nothing was counted. A dispatcher
    over its budget is not fixed by larger pools: that step is only skipped."""

    name = "grow"
    reads_before_optimizer = False
    growth_factor: float = GROWTH_FACTOR

    def outcome(self, report: OverflowReport | None) -> str:
        if report is None:
            return "update skipped, pools grow"
        return f"update skipped, the {report.tier} tier grows to {report.grown_rows:,} rows"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        if not flags.overflow_ranks or not step.grow_pools(self.growth_factor):
            return "skip"  # nothing of ours to grow (Megatron-Core's manager): only dropped
        return "grow"


POLICIES: dict[str, type[OverflowPolicy]] = {
    cls.name: cls for cls in (RerunPolicy, SkipPolicy, GrowPolicy)
}

__all__ = [
    "GROWTH_FACTOR",
    "POLICIES",
    "GrowPolicy",
    "OverflowPolicy",
    "RerunPolicy",
    "SkipPolicy",
    "StepControl",
    "StepFlags",
]
