"""Where Megatron-Core's fine-grained offloading checks are lifted — the one visible place.

Megatron-Core 0.19.2 ties ``--fine-grained-activation-offloading`` to Transformer Engine and
refuses it next to ``--moe-paged-stash`` for expert modules. Each lift below applies only where
the reason for the check does not hold, and :func:`megatron_paging.mcore.install` (or, for the
argument check that runs before ``install()``, :func:`offload_args_lift`) applies it:

* ``validate_args`` asserts ``--transformer-impl transformer_engine``: Megatron-Core's manager
  needs TE's ``cpu_offload`` switch, which only tells TE modules that offloading is on. The
  paged backend does not use it; the local (TE-free) spec has no TE module to tell. Lifted for
  ``--paging-offload-backend paged``, and for ``mcore`` when TE is absent (next point).
* Without TE, Megatron-Core's ``PipelineOffloadManager.__enter__`` raises for the missing
  ``cpu_offload`` module. :class:`FakeTECpuOffload` — a **fake** of Transformer Engine's
  ``cpu_offload`` module, holding nothing but its ``CPUOffloadEnabled`` switch — stands in so
  Megatron-Core's own offloading runs on the local spec as the benchmarks' baseline. Installed
  only when TE is absent and ``--paging-offload-backend mcore`` offloads.
* ``TransformerConfig`` refuses ``expert_fc1`` / ``moe_act`` with ``--moe-paged-stash`` ("paged
  stash covers those activations"): with the paged backend both run in one runtime (stashed
  records on the device tier, offloaded ones on the host tier), so the check is skipped for
  those two names only. It also demands ``--fine-grained-offloading-max-inflight-offloads``
  under full-iteration CUDA graphs (its main stream may not wait on its D2H events); the paged
  backend never waits on an offload except where it reloads, so that demand is lifted too.
  Every other check of Megatron-Core's runs unchanged.
* ``training.py`` pins CPU affinity through cuda-python and pynvml when offloading; where they
  are missing it logs one line and goes on (an optimisation, not a requirement).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging

from megatron_paging.mcore.offloading.backend import EXPERT_MODULES

logger = logging.getLogger(__name__)

ARGUMENTS_MODULE = "megatron.training.arguments"
TE_EXTENSION_MODULE = "megatron.core.extensions.transformer_engine"
AFFINITY_MODULE = "megatron.core.pipeline_parallel.utils"
AFFINITY_NAME = "set_ideal_affinity_for_current_gpu"


def te_available() -> bool:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - any import failure means no usable TE
        return False
    return True


class FakeTECpuOffload:
    """A fake of Transformer Engine's ``cpu_offload`` module (TE cannot be installed on our
    machines): only the ``CPUOffloadEnabled`` switch Megatron-Core's manager flips."""

    CPUOffloadEnabled = False


def _needs_lift(args) -> bool:
    if not getattr(args, "fine_grained_activation_offloading", False):
        return False
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        return False
    backend = getattr(args, "paging_offload_backend", "mcore")
    return backend == "paged" or not te_available()


def lifted_validate_args(validate_args):
    """``validate_args`` without its TE-only offloading assertion where it does not apply."""

    @functools.wraps(validate_args)
    def wrapped(args, *rest, **kwargs):
        if not _needs_lift(args):
            return validate_args(args, *rest, **kwargs)
        args.fine_grained_activation_offloading = False  # guards exactly that assertion
        try:
            return validate_args(args, *rest, **kwargs)
        finally:
            args.fine_grained_activation_offloading = True

    wrapped.megatron_paging_shim = True
    return wrapped


@contextlib.contextmanager
def offload_args_lift():
    """Around ``parse_and_validate_args`` (it runs before ``install()``): the argument lift."""
    arguments = importlib.import_module(ARGUMENTS_MODULE)
    original = arguments.validate_args
    arguments.validate_args = lifted_validate_args(original)
    try:
        yield
    finally:
        arguments.validate_args = original


def lifted_post_init(original_post_init):
    """``TransformerConfig.__post_init__`` that lets ``expert_fc1`` / ``moe_act`` offloading
    run beside ``moe_paged_stash`` (installed only with the paged offloading backend)."""

    @functools.wraps(original_post_init)
    def __post_init__(self):
        modules = list(getattr(self, "offload_modules", None) or [])
        lifted = [m for m in modules if m in EXPERT_MODULES]
        stash_lift = bool(getattr(self, "moe_paged_stash", False) and lifted)
        # Megatron-Core's full-iteration graphs need its max-inflight cap (its main stream may
        # not wait on its D2H events); ours reads it from the arguments, default 2 (sources.py).
        inflight_lift = (
            getattr(self, "fine_grained_activation_offloading", False)
            and getattr(self, "cuda_graph_impl", "none") == "full_iteration"
            and getattr(self, "fine_grained_offloading_max_inflight_offloads", None) is None
        )
        if not (stash_lift or inflight_lift):
            return original_post_init(self)
        if stash_lift:
            self.offload_modules = [m for m in modules if m not in EXPERT_MODULES]
            if not self.offload_modules:  # Megatron-Core asserts a non-empty list
                self.offload_modules = ["core_attn"]
        if inflight_lift:
            self.fine_grained_offloading_max_inflight_offloads = 0
        try:
            return original_post_init(self)
        finally:
            self.offload_modules = modules
            if inflight_lift:
                self.fine_grained_offloading_max_inflight_offloads = None

    __post_init__.megatron_paging_offload_shim = True
    return __post_init__


def tolerant_affinity(set_affinity):
    """CPU affinity pinning that logs one line instead of failing without cuda-python/pynvml."""

    @functools.wraps(set_affinity)
    def wrapped(*args, **kwargs):
        try:
            return set_affinity(*args, **kwargs)
        except (ImportError, RuntimeError) as error:
            logger.info("paging offload: CPU affinity not pinned (%s)", error)
            return None

    return wrapped


__all__ = [
    "AFFINITY_MODULE",
    "AFFINITY_NAME",
    "FakeTECpuOffload",
    "TE_EXTENSION_MODULE",
    "lifted_post_init",
    "lifted_validate_args",
    "offload_args_lift",
    "te_available",
    "tolerant_affinity",
]
