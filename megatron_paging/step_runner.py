"""Overflow handling around a driver's training steps, in one place for every driver.

The demo's paged run and the Megatron runner (:mod:`megatron_paging.mcore.runner`) both hand
their steps to a :class:`StepRunner`; they supply only what is theirs (how to run a
forward-backward again without paging, how to grow the pools, where the flags come from)::

    forward-backward                    the driver's, paged
    reduce(paging flags, over budget)   pack the flags: the step's one collective, no host read
    after_forward_backward(reduced, rerun)
                                        a policy that reads before the optimizer ('rerun') reads
                                        them now and may repeat the step unpaged; 'skip' and
                                        'grow' read them now too unless every optimizer is fused
                                        (see below)
    optimizer.step()                    the driver's; dropped when the step is discarded
                                        (optimizer_skip.DeviceSkip)
    settle()                            the deferred read of 'skip' / 'grow' with fused
                                        optimizers: after the optimizer step, when the driver
                                        likes (the Megatron runner: when the next step starts)

Why 'skip' and 'grow' read early with a non-fused optimizer: dropping its step on the device
without a host read means stepping and then blending the old values back, which keeps a copy of
every stepped parameter and optimizer state tensor during the step: an overflowing step would
then need more memory than a pool large enough not to overflow. Fused torch optimizers take
the flag as ``found_inf`` and need no copy, so with them the read stays deferred.

The policies themselves, the flag layout and the counts live in :mod:`megatron_paging.overflow`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.overflow.monitor import (
    DemandSource,
    OverflowMonitor,
    OverflowPolicy,
    StepFlags,
    skip_flag,
)
from megatron_paging.overflow.optimizer_skip import (
    DeviceSkip,
    device_resident_steps,
    uses_found_inf,
)
from megatron_paging.pages.pool import PagingFlags

# rerun(flags of the attempt) repeats the step's forward-backward without paging (same data,
# same random draws) and returns the rerun's reduced flags.
Rerun = Callable[[StepFlags], torch.Tensor]


@dataclass(frozen=True)
class Decision:
    """What the policy did about one step, and the flags it saw."""

    action: str  # 'ok', 'rerun', 'skip', 'grow' (or a new policy's own)
    flags: StepFlags


@dataclass(frozen=True)
class _Control:
    """The :class:`~megatron_paging.overflow.StepControl` a policy acts through."""

    rerun: Callable[[], None]
    grow: Callable[[float], None]

    def rerun_unpaged(self) -> None:
        self.rerun()

    def grow_pools(self, factor: float) -> None:
        self.grow(factor)


class StepRunner:
    """One driver's overflow handling: flags reduced once per step, the optimizer's device
    skip, the policy's decision (before the optimizer step or deferred), the rerun's checks.

    Args:
        policy: an :class:`OverflowPolicy`, a config or a policy name.
        grow: enlarges the device page tiers by a factor (the 'grow' policy).
        optimizers: the torch optimizers of the run. 'skip' and 'grow' route their ``step``
            through :class:`~megatron_paging.overflow.optimizer_skip.DeviceSkip`: with a device flag
            when every one is fused (no host read, no copy), else with the decision read on
            the host after forward-backward; 'rerun' leaves them as built, since it repairs
            the step before the optimizer sees it.
        group: process group of the flag all_reduce (default: the world, if initialized).
        demand: this rank's page demand (the ``PagingEngine``): its counts ride with the
            flags, and the monitor logs and keeps the report of a step that overflowed here.
    """

    def __init__(
        self,
        policy: OverflowPolicy | PagingConfig | str,
        *,
        grow: Callable[[float], None],
        optimizers: Sequence[torch.optim.Optimizer] = (),
        group=None,
        demand: DemandSource | None = None,
    ):
        self.monitor = OverflowMonitor(policy, group=group, demand=demand)
        self.grow = grow
        # the last step's skip: a device flag (deferred read) or the host's decision
        self.skip: torch.Tensor | bool | None = None
        self._pending: torch.Tensor | None = None  # reduced flags awaiting settle()
        self.device_skips: list[DeviceSkip] = []
        self.steps_made_device_resident = False
        deferred = not self.policy.reads_before_optimizer
        # deferred on the device only where the optimizers take the flag without a copy
        self.reads_deferred = deferred and all(uses_found_inf(o) for o in optimizers)
        if deferred:
            for optimizer in optimizers:
                if self.reads_deferred:
                    self.steps_made_device_resident |= device_resident_steps(optimizer)
                self.device_skips.append(DeviceSkip(optimizer, lambda: self.skip))

    @property
    def policy(self) -> OverflowPolicy:
        return self.monitor.policy

    @property
    def skipped_steps(self) -> int:
        return self.monitor.skipped_steps

    def reduce(
        self,
        paging_flags: PagingFlags | None,
        over_budget: Iterable[torch.Tensor | None] = (),
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The step's flags packed and summed over ranks: one collective, no host read."""
        return self.monitor.reduce(paging_flags, over_budget, device)

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
        flags = self.monitor.read(reduced)
        if self.policy.reads_before_optimizer:
            return self._decide(flags, lambda: self.rerun(rerun, flags))
        decision = self._decide(flags, self._too_late_to_rerun)
        self.skip = flags.discard  # known on the host: the optimizer step is not called
        return decision

    def settle(self) -> Decision | None:
        """The deferred read and decision of the last step (None if none is pending)."""
        if self._pending is None:
            return None
        reduced, self._pending = self._pending, None
        return self._decide(self.monitor.read(reduced), self._too_late_to_rerun)

    def rerun(self, run_unpaged: Rerun, flags: StepFlags, training: bool = True) -> None:
        """Repeat a step without paging; a training step's optimizer then follows the rerun's
        flags, which must be clean (an evaluation leaves the training step's skip flag)."""
        reduced = run_unpaged(flags)
        if training:
            self.skip = skip_flag(reduced)
        still = self.monitor.read(reduced)
        if still.discard:
            raise RuntimeError(f"paging: the step rerun without paging still raised {still}")

    def _decide(self, flags: StepFlags, rerun: Callable[[], None]) -> Decision:
        return Decision(self.monitor.decide(flags, _Control(rerun, self.grow)), flags)

    def _too_late_to_rerun(self) -> None:
        raise RuntimeError(
            f"paging: policy {self.policy.name!r} reads its flags after the optimizer step, "
            "too late to rerun the step (a rerunning policy sets reads_before_optimizer)"
        )


__all__ = ["Decision", "Rerun", "StepRunner"]
