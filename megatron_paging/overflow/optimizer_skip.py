"""The device-side optimizer skip: a step whose flags say "discard" updates nothing, with no host
read of the flag.

Paging's ``skip`` and ``grow`` policies drop an overflowed step's update on the device
(:mod:`megatron_paging.overflow.monitor` decides when). :func:`step_unless` steps an optimizer
unless a one-element device flag is set; :class:`DeviceSkip` routes every ``optimizer.step()``
through it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _as_skip(skip: torch.Tensor) -> torch.Tensor:
    if not isinstance(skip, torch.Tensor) or skip.numel() != 1:
        raise ValueError(f"skip must be a one-element device tensor, got {skip!r}")
    return skip.reshape(()) != 0


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def uses_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its own update on a device ``found_inf`` flag."""
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

    if uses_found_inf(optimizer):
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

    ``get_skip`` returns the current device flag, a decision already known on the host (True:
    the step is not called at all; False: it runs as usual), or None to step normally.
    ``host_reads`` counts the steps that needed the first-step host read. ``remove()`` restores
    the optimizer's own ``step``.
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
            if skip is None or skip is False:
                return self._original_step(closure)
            if skip is True:
                return None
            self.host_reads += step_unless(optimizer, skip, closure, self._original_step)
            return None

        optimizer.step = step

    def remove(self) -> None:
        self.optimizer.step = self._original_step


__all__ = ["DeviceSkip", "device_resident_steps", "step_unless", "uses_found_inf"]
