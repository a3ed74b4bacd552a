"""PagingConfig: every paging option, typed and validated once, where it enters the program.

The boundaries that build one — Megatron's flags (:mod:`megatron_paging.mcore.flags`), the
demo's command line and the Python API — catch :class:`ConfigError` and report it in their own
words (the flag or variable that holds the bad value, one line). Everything below the boundary
(engine, scheduler, calibration, kernels) trusts the config it is given.

``MEGATRON_PAGING_MAX_CTAS`` is read here, through :func:`max_ctas_from_env`, when a config is
built for a run — never at import, so ``--help`` and ``megatron-paging info`` work with a bad
value.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

MAX_CTAS_ENV = "MEGATRON_PAGING_MAX_CTAS"
DEFAULT_MAX_CTAS = 2048
POOL_RESIDENCIES = ("persistent", "step")
# Where the Megatron adapter reports the end of a layer's backward (PagingConfig.prefetch_point).
PREFETCH_POINTS = ("experts", "dispatcher")
# When a committed layer's stash is issued (PagingConfig.stash_point).
STASH_POINTS = ("commit", "next-layer")


class ConfigError(ValueError):
    """One bad option: ``field`` names it (a config field or an environment variable)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem

    def renamed(self, names: Mapping[str, str]) -> ConfigError:
        """The same error under the name a boundary uses for the field (e.g. its flag)."""
        return ConfigError(names.get(self.field, self.field), self.problem)


def positive_int(field: str, value) -> int:
    """``value`` if it is an int > 0 (not a bool), else ConfigError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")
    return value


def non_negative_int(field: str, value) -> int:
    """``value`` if it is an int >= 0 (not a bool), else ConfigError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, f"must be a non-negative integer, got {value!r}")
    return value


def _number(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    return float(value)


def max_ctas_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``MEGATRON_PAGING_MAX_CTAS`` as a positive int, None when unset; ConfigError if bad."""
    environ = os.environ if environ is None else environ
    raw = environ.get(MAX_CTAS_ENV)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(
            MAX_CTAS_ENV,
            f"must be a positive integer (it bounds the copy kernels' grid), got {raw!r}",
        )
    return value


def kernel_backend_choices() -> tuple[str, ...]:
    """``auto`` and every registered kernel backend (:data:`megatron_paging.kernels.REGISTRY`)."""
    from megatron_paging.kernels import REGISTRY  # the registry imports this module

    return ("auto", *REGISTRY)


def overflow_policy_choices() -> tuple[str, ...]:
    """Every overflow policy (:data:`megatron_paging.overflow.POLICIES`)."""
    from megatron_paging.overflow import POLICIES  # it imports this module

    return tuple(POLICIES)


@dataclass(frozen=True)
class PagingConfig:
    """What a paging run does. Field by field (docs/mcore.md lists the flags that set them):

    page_size: rows per page.
    cuda_factor: device tier = ``|cuda_factor|`` x the calibrated peak rows in flight.
        Megatron-Core's sign convention: positive sizes from the dispatcher's average-token
        hint (``avg_num_tokens``) where records carry one, else from the measured peak;
        negative always from the measured peak. Must not be 0.
    host_factor: pinned host tier, same convention; 0 = no host tier.
    kernel_backend: ``auto`` (CUDA kernels on CUDA tensors, else the reference), ``cuda``
        (the CUDA kernels, bulk or tile path chosen per record), ``tile``, ``bulk`` (one
        path forced), ``reference`` (pure torch).
    max_ctas: grid bound of the copy kernels (None: ``MEGATRON_PAGING_MAX_CTAS``, else 2048).
    prefetch_distance: paged layers reloaded ahead of the one whose backward starts.
    overlap: False runs stash and reload on the compute stream (the no-overlap control).
    overflow_policy: ``rerun``, ``skip`` or ``grow`` (docs/overflow.md).
    growth_factor: device-tier multiplier of the ``grow`` policy.
    offload_host_factor: host tier of the offload pools = this x the calibrated peak of
        offloaded live rows in flight (>= 1; routing changes live counts between steps).
    offload_d2h_max_ctas, offload_h2d_max_ctas: grid bounds of the copy kernels that move
        offloaded live-row records to the host and back (PCIe, not HBM, bounds them). On the
        H200 (benchmarks/results/offload_h200.json) D2H reaches 51.9 GB/s with 4 CTAs (52.2
        with 8) while a GEMM beside it slows by 6.8% instead of 14.7%; H2D needs 8 (33.1 GB/s
        with 4, 51.3 with 8). More CTAs only take SMs from the compute.
    offload_dma_prefix: the first rows of an offloaded live-row buffer that the copy engine
        moves (one DMA copy to a pinned arena range, like a whole tensor), as a fraction of
        the smallest live count the calibration step saw for that buffer shape (capacity rows,
        row bytes); the kernels move only the live rows past that prefix. The host must know a
        copy's size, and it never reads a live count after calibration, so the prefix is a
        host constant: when a later step's live count is below it, the padding rows up to it
        cross PCIe too (harmless: nothing reads them). The copy engine takes no SMs, so the
        compute beside it does not slow (``offload_h200.json``: a GEMM beside a D2H copy 0.99x
        against 1.07x beside the 4-CTA kernel). 0 = every live row through the kernels.
    offload_in_flight: inside a CUDA-graph capture, the compute stream waits on an offload's
        copy (before its source's memory is reused) once more than this many groups of the same
        module name are in flight (Megatron-Core's
        ``--fine-grained-offloading-max-inflight-offloads``; eagerly it never waits).
    stash_in_flight: at most this many layers' stash sources (capacity-sized, allocated until
        copied, beside the pool) at once, the opening layer's included: when a layer's slot
        opens, older layers' sources go, after a compute-stream wait on copies the host has not
        seen end (never a host wait: a host far ahead of the GPU would otherwise hold them
        all); 0 = no bound.
    pool_residency: ``persistent`` keeps the device tier's pages allocated for the whole run;
        ``step`` frees them when a step ends and allocates them again when the next begins, so
        the memory between steps (the optimizer step) does not carry the pool. ``step`` cannot
        be captured in a CUDA graph (the pages' addresses change), and the engine refuses it
        there.
    hold_last_slot: a committed slot's stash waits for the next commit; a slot whose backward
        starts first (the last layer before a backward) is never stashed or reloaded, and
        calibration sizes the pool without it (docs/scheduler.md).
    stash_point: when a committed layer's stash is issued: ``commit`` (at once) or
        ``next-layer`` (when the next layer's slot opens, right before its experts' GEMMs,
        so the copies run beside compute-bound kernels instead of the memory-bound ones after
        a commit; its sources stay until the layer after that opens). ``next-layer`` holds the
        newest layer as ``hold_last_slot`` does: a slot whose backward starts first is never
        stashed. docs/scheduler.md.
    prefetch_point: where Megatron-Core's adapter ends a layer's backward, which is when the
        layers below are reloaded: ``experts`` (when the experts' input has its gradient, so
        the reloads run beside the dispatcher's backward gathers) or ``dispatcher`` (when the
        static dispatcher's input has it, so they run beside the attention's backward;
        needs ``--moe-flex-dispatcher-backend static``). docs/scheduler.md.
    """

    page_size: int = 64
    cuda_factor: float = 1.10
    host_factor: float = 0.0
    kernel_backend: str = "auto"
    max_ctas: int | None = None
    prefetch_distance: int = 1
    overlap: bool = True
    overflow_policy: str = "rerun"
    growth_factor: float = 1.5
    offload_host_factor: float = 1.25
    offload_d2h_max_ctas: int = 4
    offload_h2d_max_ctas: int = 8
    offload_dma_prefix: float = 0.0
    offload_in_flight: int = 2
    stash_in_flight: int = 1
    pool_residency: str = "persistent"
    hold_last_slot: bool = False
    prefetch_point: str = "experts"
    stash_point: str = "commit"

    def __post_init__(self):
        positive_int("page_size", self.page_size)
        if _number("cuda_factor", self.cuda_factor) == 0:
            raise ConfigError("cuda_factor", "must be non-zero (it sizes the device page tier)")
        _number("host_factor", self.host_factor)
        if self.kernel_backend not in kernel_backend_choices():
            raise ConfigError(
                "kernel_backend",
                f"must be one of {kernel_backend_choices()}, got {self.kernel_backend!r}",
            )
        if self.max_ctas is not None:
            positive_int("max_ctas", self.max_ctas)
        non_negative_int("prefetch_distance", self.prefetch_distance)
        for name in ("overlap", "hold_last_slot"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be True or False, got {getattr(self, name)!r}")
        if self.overflow_policy not in overflow_policy_choices():
            raise ConfigError(
                "overflow_policy",
                f"must be one of {overflow_policy_choices()}, got {self.overflow_policy!r}",
            )
        if _number("growth_factor", self.growth_factor) <= 1:
            raise ConfigError("growth_factor", f"must be > 1, got {self.growth_factor!r}")
        if _number("offload_host_factor", self.offload_host_factor) < 1:
            raise ConfigError(
                "offload_host_factor", f"must be >= 1, got {self.offload_host_factor!r}"
            )
        positive_int("offload_d2h_max_ctas", self.offload_d2h_max_ctas)
        positive_int("offload_h2d_max_ctas", self.offload_h2d_max_ctas)
        if not 0 <= _number("offload_dma_prefix", self.offload_dma_prefix) <= 1:
            raise ConfigError(
                "offload_dma_prefix", f"must be in [0, 1], got {self.offload_dma_prefix!r}"
            )
        non_negative_int("offload_in_flight", self.offload_in_flight)
        non_negative_int("stash_in_flight", self.stash_in_flight)
        if self.pool_residency not in POOL_RESIDENCIES:
            raise ConfigError(
                "pool_residency",
                f"must be one of {POOL_RESIDENCIES}, got {self.pool_residency!r}",
            )
        if self.stash_point not in STASH_POINTS:
            raise ConfigError(
                "stash_point", f"must be one of {STASH_POINTS}, got {self.stash_point!r}"
            )
        if self.prefetch_point not in PREFETCH_POINTS:
            raise ConfigError(
                "prefetch_point",
                f"must be one of {PREFETCH_POINTS}, got {self.prefetch_point!r}",
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields) -> PagingConfig:
        """A config whose unset ``max_ctas`` comes from ``MEGATRON_PAGING_MAX_CTAS``."""
        if fields.get("max_ctas") is None:
            fields["max_ctas"] = max_ctas_from_env(environ)
        return cls(**fields)

    def replace(self, **changes) -> PagingConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def grid_bound(self) -> int:
        """The grid bound the copy kernels use."""
        return DEFAULT_MAX_CTAS if self.max_ctas is None else self.max_ctas


__all__ = [
    "ConfigError",
    "DEFAULT_MAX_CTAS",
    "MAX_CTAS_ENV",
    "POOL_RESIDENCIES",
    "PREFETCH_POINTS",
    "STASH_POINTS",
    "PagingConfig",
    "kernel_backend_choices",
    "max_ctas_from_env",
    "non_negative_int",
    "overflow_policy_choices",
    "positive_int",
]
