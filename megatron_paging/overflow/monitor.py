"""Overflow handling around a driver's training steps, in one place for every driver.

The demo's paged run and the Megatron runner (:mod:`megatron_paging.mcore.runner`) both hand
their steps to one :class:`OverflowMonitor`; they supply only what is theirs (how to run a
forward-backward again, paged or not, how to grow the pools, where the flags come from).
Where it sits in a training step (never inside a CUDA-graph-captured region)::

    forward-backward                    the driver's, paged (may be graph-captured): stashes set
                                        sticky flags and count their page demand on the device
                                        (demand.py)
    reduce(paging flags, over budget)   pack the local flags, this rank's demand counts behind
                                        them: the step's ONE all_reduce, no host read
    after_forward_backward(reduced, rerun)
                                        a policy that reads before the optimizer ('rerun') reads
                                        them now and may repeat the step; 'skip' and
                                        'grow' read them now too unless every optimizer is fused
                                        (see below)
    optimizer.step()                    the driver's; dropped when the step is discarded
                                        (optimizer_skip.DeviceSkip)
    settle()                            the deferred read of 'skip' / 'grow' with fused
                                        optimizers: after the optimizer step, when the driver
                                        likes (the Megatron runner: when the next step starts)

A read logs (one line per overflowing pool group of this rank: where, rows needed vs held, the
factor that fits), counts, and lets the policy (:mod:`megatron_paging.overflow.policy`) act on a
step to discard.

Why 'skip' and 'grow' read early with a non-fused optimizer: dropping its step on the device
without a host read means stepping and then blending the old values back, which keeps a copy of
every stepped parameter and optimizer state tensor during the step: an overflowing step would
then need more memory than a pool large enough not to overflow. Fused torch optimizers take
the flag as ``found_inf`` and need no copy, so with them the read stays deferred.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_paging.overflow.demand import OverflowReport
from megatron_paging.overflow.optimizer_skip import (
    DeviceSkip,
    device_resident_steps,
    uses_found_inf,
)
from megatron_paging.overflow.policy import OverflowPolicy, StepControl, StepFlags

logger = logging.getLogger(__name__)

SPILL_ADVICE = (
    "the step stays exact, only slower; a larger --moe-paged-stash-buffer-size-factor-cuda "
    "keeps them on the device"
)
OVER_BUDGET_ADVICE = (
    "the step is discarded; a larger --moe-expert-rank-capacity-factor raises the budget"
)

# Slots of the packed flag tensor: one all_reduce moves all of them.
OVERFLOW, HOST_SPILL, INVALID_LIVE, OVER_BUDGET = range(4)
NUM_FLAGS = 4

# rerun(flags of the attempt, paged) repeats the step's forward-backward (same data, same random
# draws), through the pools as they are now or without paging, and returns its reduced flags.
Rerun = Callable[[StepFlags, bool], torch.Tensor]


class DeviceFlags(Protocol):
    """A step's sticky paging flags (``PagingFlags``, or a driver's stand-in): ``values`` is
    int ``[3]`` (overflow, host spill, invalid live) on ``device``."""

    values: torch.Tensor
    device: torch.device


class DemandSource(Protocol):
    """Where a rank's page demand comes from (``PagingEngine``)."""

    def demand_values(self) -> torch.Tensor | None:
        """The step's counts as one int64 device tensor (no sync); None: nothing counted."""

    def overflow_reports(self, values: tuple[int, ...], rank: int,
                         step: int) -> list[OverflowReport]:
        """This rank's reports for the host values of :meth:`demand_values`."""


def pack_flags(
    paging_flags: DeviceFlags | None,
    over_budget: Iterable[torch.Tensor | None] = (),
    device: torch.device | str | None = None,
    demand: torch.Tensor | None = None,
) -> torch.Tensor:
    """The local flags as one int64 device tensor: ``[4]`` (see OVERFLOW..OVER_BUDGET), then
    ``demand`` (this rank's demand counts, demand.pack) if given. No sync."""
    if device is None:
        device = paging_flags.device if paging_flags is not None else "cpu"
    extra = 0 if demand is None else demand.numel()
    packed = torch.zeros(NUM_FLAGS + extra, dtype=torch.int64, device=device)
    if paging_flags is not None:
        packed[OVERFLOW : INVALID_LIVE + 1] = (paging_flags.values != 0).to(device, torch.int64)
    for flag in over_budget:
        if flag is not None:
            packed[OVER_BUDGET] |= (flag.reshape(-1)[0] != 0).to(device, torch.int64)
    if extra:
        packed[NUM_FLAGS:] = demand
    return packed


def skip_flag(reduced: torch.Tensor) -> torch.Tensor:
    """0-d bool device tensor: the step must not update parameters. No sync."""
    return (reduced[OVERFLOW] + reduced[INVALID_LIVE] + reduced[OVER_BUDGET]) > 0


def _run_short_of_memory(run: Rerun, flags: StepFlags, paged: bool, training: bool):
    """``run(flags, paged)``; a rerun that runs out of memory ends with one line that says
    which rerun it was and what to set (the allocator's own message stays as its cause)."""
    try:
        return run(flags, paged)
    except torch.OutOfMemoryError as err:
        if not training:
            what = ("an evaluation that dropped tokens or overflowed, rerun unpaged, ran out of "
                    "memory; raise --moe-expert-rank-capacity-factor or "
                    "--moe-paged-stash-buffer-size-factor-cuda so evaluations fit")
        else:
            what = ("the rerun of an overflowing step, in pools grown to what it needed,"
                    if paged else "the unpaged rerun of an overflowing step (it needs the "
                    "unpaged peak)")
            what += (" ran out of memory; use --paging-overflow-policy skip (the step's update "
                     "is dropped) or a pool factor `megatron-paging plan` sizes for rarer "
                     "overflows (--moe-paged-stash-buffer-size-factor-cuda), if it fits")
        raise torch.OutOfMemoryError(f"paging: {what}") from err


@dataclass(frozen=True)
class Decision:
    """What the policy did about one step, and the flags it saw."""

    action: str  # 'ok', 'rerun', 'skip', 'grow' (or a new policy's own)
    flags: StepFlags


@dataclass(frozen=True)
class _Control:
    """The :class:`~megatron_paging.overflow.policy.StepControl` a policy acts through."""

    run_again: Callable[[bool], None]
    grow: Callable[[float], bool | None] | None

    def rerun(self, paged: bool) -> None:
        self.run_again(paged)

    def grow_pools(self, factor: float) -> bool:
        try:
            return self.grow is not None and self.grow(factor) is not False
        except torch.OutOfMemoryError as err:
            raise torch.OutOfMemoryError(
                "paging: growing the pools to what an overflowing step needed ran out of memory; "
                "use --paging-overflow-policy skip (the step's update is dropped)"
            ) from err


class OverflowMonitor:
    """One driver's overflow handling: flags reduced once per step across ranks, the optimizer's
    device skip, one host read, the policy's decision (before the optimizer step or deferred),
    the rerun's checks, the log and the counts.

    Args:
        policy: the run's policy (``PagingConfig.overflow_policy``).
        grow: enlarges the pools by a factor, for a policy that grows them ('rerun', 'grow');
            returns False when the driver has no pools of its own to grow.
        optimizers: the torch optimizers of the run. A policy that reads after the optimizer
            ('skip', 'grow') routes their ``step`` through
            :class:`~megatron_paging.overflow.optimizer_skip.DeviceSkip`: with a device flag when
            every one is fused (no host read, no copy), else with the decision read on the host
            after forward-backward; 'rerun' leaves them as built, since it repairs the step
            before the optimizer sees it.
        group: process group of the flag all_reduce (default: the world, if initialized).
        demand: this rank's page demand (a :class:`DemandSource`, the ``PagingEngine``): its
            counts ride behind the flags, and each report of a step that overflowed here
            becomes one line and one entry of :attr:`overflow_records`.
    """

    def __init__(
        self,
        policy: OverflowPolicy,
        *,
        grow: Callable[[float], bool | None] | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        group=None,
        demand: DemandSource | None = None,
    ):
        if not isinstance(policy, OverflowPolicy):
            raise TypeError(
                f"policy must be an OverflowPolicy (PagingConfig builds it from the flag's "
                f"name), got {policy!r}"
            )
        self.policy = policy
        self.grow = grow
        self.group = group
        self.demand = demand
        self.overflow_records: list[dict] = []  # one per report, as JSON-ready dicts
        self.steps = 0
        self.actions: Counter[str] = Counter()  # 'ok', 'rerun', 'skip', 'grow' per step
        self.spill_steps = 0
        self.unpaged_reruns = 0  # paged reruns that overflowed again and ran unpaged
        # the last step's skip: a device flag (deferred read) or the host's decision
        self.skip: torch.Tensor | bool | None = None
        self._pending: torch.Tensor | None = None  # reduced flags awaiting settle()
        self.device_skips: list[DeviceSkip] = []
        self.steps_made_device_resident = False
        deferred = not policy.reads_before_optimizer
        # deferred on the device only where the optimizers take the flag without a copy
        self.reads_deferred = deferred and all(uses_found_inf(o) for o in optimizers)
        if deferred:
            for optimizer in optimizers:
                if self.reads_deferred:
                    self.steps_made_device_resident |= device_resident_steps(optimizer)
                self.device_skips.append(DeviceSkip(optimizer, lambda: self.skip))

    @property
    def rerun_steps(self) -> int:
        return self.actions["rerun"]

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was dropped (skip and grow)."""
        return self.actions["skip"] + self.actions["grow"]

    @property
    def grown_steps(self) -> int:
        return self.actions["grow"]

    # -- one step ----------------------------------------------------------------------------
    def reduce(
        self,
        paging_flags: DeviceFlags | None,
        over_budget: Iterable[torch.Tensor | None] = (),
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Pack the local flags and sum them over ranks: the step's one collective, no host
        read. This rank's demand counts ride behind them, outside the sum."""
        values = self.demand.demand_values() if self.demand is not None else None
        packed = pack_flags(paging_flags, over_budget, device, values)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed[:NUM_FLAGS], op=dist.ReduceOp.SUM, group=self.group)
        return packed

    def after_forward_backward(self, reduced: torch.Tensor, rerun: Rerun) -> Decision | None:
        """Act on a training step's reduced flags before its optimizer step.

        They become the optimizer's skip flag. A policy that reads before the optimizer reads
        them now and decides (its rerun goes through :meth:`rerun`); the others keep them for
        :meth:`settle` and None is returned.
        """
        self.skip = skip_flag(reduced)
        if self.reads_deferred:
            self._pending = reduced
            return None
        flags = self.read(reduced)
        if self.policy.reads_before_optimizer:
            return self._decide(flags, lambda paged: self.rerun(rerun, flags, paged=paged))
        decision = self._decide(flags, self._too_late_to_rerun)
        self.skip = flags.discard  # known on the host: the optimizer step is not called
        return decision

    def settle(self) -> Decision | None:
        """The deferred read and decision of the last step (None if none is pending)."""
        if self._pending is None:
            return None
        reduced, self._pending = self._pending, None
        return self._decide(self.read(reduced), self._too_late_to_rerun)

    def rerun(self, run: Rerun, flags: StepFlags, training: bool = True,
              paged: bool = False) -> None:
        """Repeat a step, paged (through the pools as they are now) or not; a training step's
        optimizer then follows the rerun's flags, which must be clean (an evaluation leaves the
        training step's skip flag). A paged rerun that still overflows (a need that was not
        counted) runs once more without paging."""
        reduced = _run_short_of_memory(run, flags, paged, training)
        still = self.read(reduced)
        if paged and still.discard and not still.invalid_live_ranks:
            logger.warning(
                "megatron-paging: step %d overflowed again in its paged rerun on %d rank(s); "
                "re-running it without paging", self.steps, still.overflow_ranks,
            )
            self.unpaged_reruns += 1
            # the attempt's flags: an over-budget step stays so
            reduced = _run_short_of_memory(run, flags, False, training)
            still = self.read(reduced)
        if training:
            self.skip = skip_flag(reduced)
        if still.discard:
            raise RuntimeError(f"paging: the step's rerun still raised {still}")

    # -- the read and the decision -------------------------------------------------------------
    def read(self, reduced: torch.Tensor) -> StepFlags:
        """The host read of a reduced flag tensor and the counts behind it (one copy;
        synchronizes: call it after the step)."""
        values = [int(v) for v in reduced.tolist()]
        return StepFlags(*values[:NUM_FLAGS], demand=tuple(values[NUM_FLAGS:]))

    def decide(self, flags: StepFlags, step: StepControl) -> str:
        """Log what happened, let the policy act on a step to discard through ``step``; returns
        the action."""
        self.steps += 1
        if flags.invalid_live_ranks:
            raise ValueError(
                f"paging: invalid input on {flags.invalid_live_ranks} rank(s): a record's "
                "live_rows outside its segment capacity, or a record reloaded twice or before "
                "its stash (PagingFlags.raise_if_invalid on a rank says which)"
            )
        if flags.host_spill_ranks:
            self.spill_steps += 1
            logger.info(
                "megatron-paging: step %d spilled activations to pinned host on %d rank(s) "
                "(device tier full): %s", self.steps, flags.host_spill_ranks, SPILL_ADVICE,
            )
        if not flags.discard:
            self.actions["ok"] += 1
            return "ok"
        if flags.over_budget_ranks:
            logger.info(
                "megatron-paging: step %d dropped tokens in MoE dispatch (over the static "
                "budget) on %d rank(s): %s", self.steps, flags.over_budget_ranks,
                OVER_BUDGET_ADVICE,
            )
        if flags.overflow_ranks:
            self._report_overflow(flags)
        action = self.policy.on_discard(flags, step)
        self.actions[action] += 1
        return action

    def _report_overflow(self, flags: StepFlags) -> None:
        """One line per pool group of this rank that overflowed: where, what it needed, the
        flag and the value that fits; a rank whose pools fitted says only what happened."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reports = []
        if self.demand is not None and flags.demand:
            reports = self.demand.overflow_reports(flags.demand, rank, self.steps)
        for report in reports:
            logger.warning(report.line(self.policy.name, self.policy.outcome(report)))
            self.overflow_records.append(report.record(self.policy.name))
        if not reports:
            logger.info(
                "megatron-paging: overflow at step %d on %d rank(s), no report on rank %d (its "
                "pools fitted, or nothing counted them): the overflowing rank's line names the "
                "flag to set (policy %s: %s)", self.steps, flags.overflow_ranks, rank,
                self.policy.name, self.policy.outcome(None),
            )

    def _decide(self, flags: StepFlags, rerun: Callable[[bool], None]) -> Decision:
        return Decision(self.decide(flags, _Control(rerun, self.grow)), flags)

    def _too_late_to_rerun(self, paged: bool = False) -> None:
        raise RuntimeError(
            f"paging: policy {self.policy.name!r} reads its flags after the optimizer step, "
            "too late to rerun the step (a rerunning policy sets reads_before_optimizer)"
        )


__all__ = [
    "Decision",
    "DemandSource",
    "DeviceFlags",
    "OverflowMonitor",
    "Rerun",
    "pack_flags",
    "skip_flag",
]
