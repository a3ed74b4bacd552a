"""Deferred overflow handling and the device-side optimizer skip.

Where this sits in a training step (never inside a CUDA-graph-captured region)::

    forward-backward (may be graph-captured; stashes set sticky flags on device)
    OverflowMonitor.reduce()   pack local flags, ONE all_reduce, no host read
    optimizer step             step_unless(): a no-op on device when the reduced flags say so
    ... next step starts ...
    OverflowMonitor.read()     the one host read of the reduced flags (deferred)
    OverflowMonitor.decide()   apply the policy: rerun / skip / grow

The flags are reduced across ranks *before* the optimizer step, so every data-parallel replica
skips or updates together; the collective is enqueued on the device and reads nothing on the
host. Only ``read`` synchronizes, and it runs after the step (the ``rerun`` policy calls it right
after forward-backward, as Megatron-Core does, because it must replace the gradients before the
optimizer consumes them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_paging.pool import PagePools, PagingFlags, ceil_div

logger = logging.getLogger(__name__)

POLICIES = ("rerun", "skip", "grow")
SPILL_ADVICE = (
    "Consider increasing moe_paged_stash_buffer_size_factor_cuda for potentially better "
    "performance."
)
OVERFLOW_ADVICE = (
    "Consider increasing moe_paged_stash_buffer_size_factor_cuda or "
    "moe_paged_stash_buffer_size_factor_cpu."
)
OVER_BUDGET_ADVICE = "Consider increasing moe_expert_rank_capacity_factor."

# Slots of the packed flag tensor: one all_reduce moves all of them.
OVERFLOW, HOST_SPILL, INVALID_LIVE, OVER_BUDGET = range(4)
NUM_FLAGS = 4


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"overflow policy must be one of {POLICIES}, got {policy!r}")
    return policy


# ---------------------------------------------------------------------------------------------
# Device-side optimizer skip
# ---------------------------------------------------------------------------------------------


def _as_skip(skip: torch.Tensor) -> torch.Tensor:
    if not isinstance(skip, torch.Tensor) or skip.numel() != 1:
        raise ValueError(f"skip must be a one-element device tensor, got {skip!r}")
    return skip.reshape(()) != 0


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _uses_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    # torch's fused Adam/AdamW/SGD skip their update on device when `found_inf` is set and
    # undo the step-counter increment (the AMP GradScaler contract).
    return getattr(optimizer, "_step_supports_amp_scaling", False) and all(
        g.get("fused", False) for g in optimizer.param_groups
    )


def step_unless(
    optimizer: torch.optim.Optimizer,
    skip: torch.Tensor,
    closure=None,
    step_fn: Callable | None = None,
) -> bool:
    """Step ``optimizer`` unless the device flag ``skip`` is non-zero, without a host read.

    Parameters and optimizer state (Adam ``exp_avg``/``exp_avg_sq``/``step``, SGD momentum) are
    left bit-for-bit as before a skipped step. Fused torch optimizers get the flag as their
    ``found_inf``; every other optimizer is stepped and then blended back with
    ``torch.where(skip, before, after)`` (costs one copy of the stepped tensors).

    State *created* by this step (an optimizer's lazy first-step init) or a python scalar in the
    state that the step changed cannot be reverted on the device: only then the flag is read on
    the host, once, and the step's state changes are undone if it was skipped. Returns True when
    that host read happened (normally only on the very first step, which is the calibration
    step that reads live counts on the host anyway).

    ``step_fn`` (default ``optimizer.step``) performs the actual step. Raises ValueError if a
    state tensor lives on another device than ``skip`` (for example torch Adam's CPU ``step``
    counters: build it with ``capturable=True`` or ``fused=True``, see
    :func:`device_resident_steps`).
    """
    skip = _as_skip(skip)
    step_fn = optimizer.step if step_fn is None else step_fn
    params = _params_with_grad(optimizer)
    had_state = {p: dict(optimizer.state[p]) for p in params if optimizer.state.get(p)}
    for entries in had_state.values():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.device != skip.device:
                raise ValueError(
                    f"optimizer state {key!r} is on {value.device} but the skip flag on "
                    f"{skip.device}; keep step counters on the device (capturable=True or "
                    "fused=True, see device_resident_steps)"
                )

    if _uses_found_inf(optimizer):
        previous = getattr(optimizer, "found_inf", None)
        optimizer.found_inf = skip.to(torch.float32)
        try:
            step_fn(closure)
        finally:
            if previous is None:
                del optimizer.found_inf
            else:
                optimizer.found_inf = previous
    else:
        before_params = [p.detach().clone() for p in params]
        before_tensors = [
            (p, key, value.clone())
            for p, entries in had_state.items()
            for key, value in entries.items()
            if isinstance(value, torch.Tensor)
        ]
        step_fn(closure)
        with torch.no_grad():
            # In place (out= aliases the stepped tensor exactly): no temporaries beyond the
            # one backup copy.
            for p, before in zip(params, before_params, strict=True):
                torch.where(skip, before, p, out=p)
            for p, key, before in before_tensors:
                after = optimizer.state[p].get(key)
                if isinstance(after, torch.Tensor):
                    torch.where(skip, before, after, out=after)
                else:
                    optimizer.state[p][key] = before

    created = [p for p in params if p not in had_state and optimizer.state.get(p)]
    added = [
        (p, key)
        for p, entries in had_state.items()
        for key in optimizer.state[p]
        if key not in entries
    ]
    changed = [
        (p, key, value)
        for p, entries in had_state.items()
        for key, value in entries.items()
        if not isinstance(value, torch.Tensor) and optimizer.state[p].get(key) != value
    ]
    if not (created or added or changed):
        return False
    if bool(skip.item()):  # the one documented host read
        for p in created:
            del optimizer.state[p]
        for p, key in added:
            del optimizer.state[p][key]
        for p, key, value in changed:
            optimizer.state[p][key] = value
    return True


def device_resident_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Make torch Adam/AdamW keep ``step`` on the parameter's device (``capturable=True``).

    Returns True when some group was switched.

    Non-capturable, non-fused torch Adam keeps ``step`` as a CPU tensor and reads it on the host
    for bias correction, so it cannot be skipped on device. Capturable Adam computes the bias
    correction on device; its numerics can differ from the non-capturable path in the last bit,
    so paged and unpaged control runs must both use it.
    """
    switched = False
    for group in optimizer.param_groups:
        if "capturable" not in group or group.get("fused") or group.get("capturable"):
            continue
        if all(p.device.type == "cpu" for p in group["params"]):
            continue  # CPU params: the step counters already live with the flag
        group["capturable"] = switched = True
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    return switched


class DeviceSkip:
    """Route every ``optimizer.step()`` through :func:`step_unless` with a flag from ``get_skip``.

    ``get_skip`` returns the current device flag, or None to step normally. ``host_reads``
    counts the steps that needed the first-step host read. ``remove()`` restores the optimizer's
    own ``step``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, get_skip: Callable[[], torch.Tensor | None]
    ):
        self.optimizer = optimizer
        self.get_skip = get_skip
        self.host_reads = 0
        self._original_step = optimizer.step

        def step(closure=None):
            skip = self.get_skip()
            if skip is None:
                return self._original_step(closure)
            self.host_reads += step_unless(optimizer, skip, closure, self._original_step)
            return None

        optimizer.step = step

    def remove(self) -> None:
        self.optimizer.step = self._original_step


# ---------------------------------------------------------------------------------------------
# Deferred flag handling
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFlags:
    """Per-flag count of ranks that raised it during one step (after the all_reduce)."""

    overflow_ranks: int = 0
    host_spill_ranks: int = 0
    invalid_live_ranks: int = 0
    over_budget_ranks: int = 0

    @property
    def discard(self) -> bool:
        """The step's gradients are wrong: its optimizer update must not be applied."""
        return bool(self.overflow_ranks or self.invalid_live_ranks or self.over_budget_ranks)


@dataclass(frozen=True)
class Decision:
    """What the driver must do about a step: 'ok', 'rerun', 'skip' or 'grow'."""

    action: str
    flags: StepFlags


def pack_flags(
    paging_flags: PagingFlags | None,
    over_budget: Iterable[torch.Tensor | None] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The local flags as one int64 ``[4]`` device tensor (see OVERFLOW..OVER_BUDGET). No sync.

    ``paging_flags`` is a :class:`PagingFlags` or anything with its ``values`` (int ``[3]``:
    overflow, host spill, invalid live) and ``device``.
    """
    if device is None:
        device = paging_flags.device if paging_flags is not None else "cpu"
    packed = torch.zeros(NUM_FLAGS, dtype=torch.int64, device=device)
    if paging_flags is not None:
        packed[OVERFLOW : INVALID_LIVE + 1] = (paging_flags.values != 0).to(device, torch.int64)
    for flag in over_budget:
        if flag is not None:
            packed[OVER_BUDGET] |= (flag.reshape(-1)[0] != 0).to(device, torch.int64)
    return packed


def skip_flag(reduced: torch.Tensor) -> torch.Tensor:
    """0-d bool device tensor: the step must not update parameters. No sync."""
    return (reduced[OVERFLOW] + reduced[INVALID_LIVE] + reduced[OVER_BUDGET]) > 0


class OverflowMonitor:
    """Reduce flags once per step across ranks, read them once (deferred), apply the policy.

    Args:
        policy: 'rerun' (repeat the step without paging, Megatron-Core's behaviour), 'skip'
            (drop the step like a loss-scale overflow) or 'grow' (drop it, then enlarge the
            CUDA tier of every pool by ``growth_factor`` for the next step).
        group: process group of the all_reduce (default: the world, if initialized).
        growth_factor: CUDA tier multiplier of the 'grow' policy (> 1).
    """

    def __init__(self, policy: str = "rerun", group=None, growth_factor: float = 1.5):
        self.policy = check_policy(policy)
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise ValueError(f"growth_factor must be a number > 1, got {growth_factor!r}")
        self.group = group
        self.growth_factor = float(growth_factor)
        self.steps = 0
        self.skipped_steps = 0
        self.rerun_steps = 0
        self.grown_steps = 0
        self.spill_steps = 0

    def reduce(
        self,
        paging_flags: PagingFlags | None,
        over_budget: Iterable[torch.Tensor | None] = (),
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Pack the local flags and sum them over ranks: the step's one collective, no host read."""
        packed = pack_flags(paging_flags, over_budget, device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        return packed

    def read(self, reduced: torch.Tensor) -> StepFlags:
        """The host read of a reduced flag tensor (synchronizes: call it after the step)."""
        return StepFlags(*(int(v) for v in reduced.tolist()))

    def decide(self, flags: StepFlags, policy: str | None = None) -> Decision:
        """Log what happened and return the action; counts steps per outcome."""
        policy = self.policy if policy is None else check_policy(policy)
        self.steps += 1
        if flags.invalid_live_ranks:
            raise ValueError(
                f"paging: a record's live_rows was negative or above its segment capacity on "
                f"{flags.invalid_live_ranks} rank(s); check the dispatcher's tokens_per_expert "
                "against the static capacity"
            )
        if flags.host_spill_ranks:
            self.spill_steps += 1
            logger.info(
                "paging: spilled activations to pinned host on %d rank(s) (CUDA pool full). %s",
                flags.host_spill_ranks,
                SPILL_ADVICE,
            )
        if not flags.discard:
            return Decision("ok", flags)
        if flags.over_budget_ranks:
            logger.info(
                "paging: token drop during MoE dispatch (over budget) on %d rank(s). %s",
                flags.over_budget_ranks,
                OVER_BUDGET_ADVICE,
            )
        if flags.overflow_ranks:
            logger.info(
                "paging: page pool overflow on %d rank(s); policy %r. %s",
                flags.overflow_ranks,
                policy,
                OVERFLOW_ADVICE,
            )
        if policy == "rerun":
            self.rerun_steps += 1
        else:
            self.skipped_steps += 1
            if policy == "grow" and flags.overflow_ranks:
                self.grown_steps += 1
            elif policy == "grow":
                policy = "skip"  # a dispatcher over-budget is not fixed by larger pools
        return Decision(policy, flags)


def grow_pools(pools: PagePools, factor: float) -> PagePools:
    """New pools with every CUDA tier ``factor`` times larger (at least one page more).

    The host tiers keep their size. The old pools are not touched; whoever holds them swaps in
    the new ones between steps (a captured CUDA graph must be re-captured: pool addresses change).
    """
    if not (isinstance(factor, (int, float)) and factor > 1):
        raise ValueError(f"factor must be a number > 1, got {factor!r}")
    grown = PagePools(pools.page_size, pools.device)
    for pool in pools:
        old_pages = pool.num_cuda_pages
        new_pages = max(old_pages + 1, math.ceil(old_pages * factor))
        grown.add(pool.row_bytes, new_pages * pool.page_size, pool.num_host_pages * pool.page_size)
        logger.info(
            "paging: grew pool row_bytes=%d from %d to %d CUDA pages",
            pool.row_bytes,
            old_pages,
            ceil_div(new_pages * pool.page_size, pool.page_size),
        )
    return grown


__all__ = [
    "POLICIES",
    "Decision",
    "DeviceSkip",
    "OverflowMonitor",
    "StepFlags",
    "device_resident_steps",
    "grow_pools",
    "pack_flags",
    "skip_flag",
    "step_unless",
]
