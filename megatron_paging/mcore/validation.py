"""Megatron's ``validate_args`` before Megatron starts, as the example's run applies it.

The plan (:mod:`megatron_paging.plan.adapter`) and the example's preflight
(``examples/preflight.py``) both need Megatron's own verdict on a launch line before anything is
built: the plan to read the layout Megatron derives, the preflight so that a layout Megatron
refuses is one line before torchrun starts rather than a traceback per rank. Both run it through
the lifts the example's run applies (the static dispatcher under ``--fake-process-group``,
offloading on the local spec), so neither refuses a line the run accepts.
"""

from __future__ import annotations

import contextlib
import io
import warnings

# validate_args asks the device's architecture (TP or CP > 1, grouped GEMM); without a GPU it is
# answered for the one the plan was validated on, an H200 (sm90).
TARGET_CAPABILITY = (9, 0)


@contextlib.contextmanager
def target_device(arguments):
    """validate_args's device queries answered as :data:`TARGET_CAPABILITY` where no GPU is."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = arguments.get_device_arch_version, torch.cuda.get_device_capability
    arguments.get_device_arch_version = lambda: TARGET_CAPABILITY[0]
    torch.cuda.get_device_capability = lambda *_, **__: TARGET_CAPABILITY
    try:
        yield
    finally:
        arguments.get_device_arch_version, torch.cuda.get_device_capability = saved


def validate(args, defaults: dict | None = None):
    """Megatron's ``validate_args(args, defaults)`` in place, with the example's lifts; its
    argument dump is dropped. A refusal is one ``ValueError`` line ("Megatron's validate_args:
    ..."); returns ``args``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE/apex-missing notices at import
        from megatron.training import arguments

        from megatron_paging.mcore.offloading.shims import lifted_validate_args
        from megatron_paging.mcore.peers import _fake_group_validation

    run = _fake_group_validation(lifted_validate_args(arguments.validate_args))
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), \
                target_device(arguments):
            warnings.simplefilter("ignore")
            run(args, dict(defaults or {}))
    except (AssertionError, ValueError, RuntimeError, TypeError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ValueError(f"Megatron's validate_args: {message}") from None
    return args


__all__ = ["TARGET_CAPABILITY", "target_device", "validate"]
