"""Paging options: the flags a user sets (:class:`PagingArgs`) and the runtime's config
(:class:`PagingConfig`), typed and validated once where they enter the program.

* :class:`PagingArgs` is the whole command-line surface megatron-paging adds to Megatron: one
  field is one flag of the same name (``paging_overflow_policy`` is ``--paging-overflow-policy``),
  its docstring is the flag's help. :mod:`megatron_paging.mcore.flags` builds the argparse group
  from it with Megatron's own ``ArgumentGroupFactory``; the demo reuses that group. Annotations
  stay real (no postponed evaluation here): the factory reads choices from ``Literal`` types.
* :class:`PagingConfig` is what the engine, scheduler and kernels read. Its pool fields come from
  Megatron-Core's own ``--moe-paged-stash*`` flags, ``max_ctas`` from ``MEGATRON_PAGING_MAX_CTAS``
  (read when a run builds its config, never at import), and a few fields have no flag: they are
  set by the Megatron adapter from Megatron's flags (``pool_residency``, ``offload_dma_prefix``,
  ``offload_in_flight``) or by benchmarks and tests through the Python API.

The boundaries that build a config catch :class:`ConfigError` and report it in their own words
(the flag or variable that holds the bad value, one line). Everything below the boundary
(engine, scheduler, calibration, kernels) trusts the config it is given.
"""

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from megatron_paging.overflow.policy import POLICIES, OverflowPolicy, RerunPolicy

MAX_CTAS_ENV = "MEGATRON_PAGING_MAX_CTAS"
DEFAULT_MAX_CTAS = 2048
MAX_GRID_BOUND = 2**31 - 1  # the kernels take the bound as a C int

OverflowPolicyName = Literal["rerun", "skip", "grow"]
OffloadBackendName = Literal["mcore", "paged"]
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicyName)
OFFLOAD_BACKENDS: tuple[str, ...] = get_args(OffloadBackendName)
# ``auto``: the CUDA kernels for CUDA pools, the pure-torch reference otherwise (kernels/).
KERNEL_BACKENDS = ("auto", "cuda", "tile", "bulk", "reference")
POOL_RESIDENCIES = ("persistent", "step")


class ConfigError(ValueError):
    """One bad option: ``field`` names it (a config field or an environment variable)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


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


def _choice(field: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"must be one of {', '.join(choices)}; got {value!r}")


def check_grid_bound(field: str, value) -> int:
    """``value`` if it is a kernel grid bound (a positive int that fits the kernels' C int), else
    ConfigError naming ``field``. The one check of a bound: the kernels trust it."""
    if positive_int(field, value) > MAX_GRID_BOUND:
        raise ConfigError(field, f"must be at most {MAX_GRID_BOUND}, got {value!r}")
    return value


def kernel_grid_bound(max_ctas: int | None, field: str = "max_ctas") -> int:
    """The copy kernels' grid bound: ``max_ctas`` checked, or :data:`DEFAULT_MAX_CTAS` for None
    (the one default). The config's ``max_ctas`` and direct kernel calls both come here."""
    return DEFAULT_MAX_CTAS if max_ctas is None else check_grid_bound(field, max_ctas)


def max_ctas_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``MEGATRON_PAGING_MAX_CTAS`` as a grid bound (:func:`kernel_grid_bound`), None when unset;
    ConfigError naming the variable and its text if it is not one."""
    environ = os.environ if environ is None else environ
    raw = environ.get(MAX_CTAS_ENV)
    if raw is None:
        return None
    try:
        return kernel_grid_bound(int(raw.strip()), MAX_CTAS_ENV)
    except ValueError:  # not an integer, or not a grid bound (ConfigError)
        raise ConfigError(
            MAX_CTAS_ENV,
            f"must be a positive integer of at most {MAX_GRID_BOUND} (it bounds the copy "
            f"kernels' grid), got {raw!r}",
        ) from None


@dataclass(frozen=True)
class PagingArgs:
    """megatron-paging's flags (docs/mcore.md). Megatron-Core's own --moe-paged-stash,
    --moe-paged-stash-page-size and --moe-paged-stash-buffer-size-factor-cuda/-cpu size the pool."""

    paging_overflow_policy: OverflowPolicyName = "rerun"
    """What a step whose pages overflowed does: rerun it before the optimizer step in pools
    grown to what it needed, skip its update on the device, or skip it and grow the device page
    tier for the steps after it."""

    paging_prefetch_distance: int = dataclasses.field(
        default=1, metadata={"argparse_meta": {"metavar": "LAYERS"}}
    )
    """How many layers below the one whose backward starts are reloaded ahead of it (0: a
    layer's reload starts with its own backward)."""

    paging_hold_last_slot: bool = False
    """Keep the last layer before each backward where it is instead of copying it out and back;
    the device page tier is then sized one layer smaller."""

    paging_recompute_expert_fc1: bool = False
    """The experts save only their input and recompute fc1 in the backward (one grouped GEMM,
    the same gradients bit for bit): paging and offloading then move the input rows instead of
    the wider fc1 output."""

    paging_offload_backend: OffloadBackendName = "mcore"
    """Backend of --fine-grained-activation-offloading: Megatron-Core's own (mcore), or
    megatron-paging's (paged: expert inputs move only their live rows, dense tensors move whole,
    both on the paging stream)."""

    paging_offload_host_factor: float = dataclasses.field(
        default=1.25, metadata={"argparse_meta": {"metavar": "FACTOR"}}
    )
    """Pinned host memory for offloaded live rows, as a multiple (>= 1) of the peak the
    calibration step measured (routing changes live counts from step to step)."""

    paging_emulated_load: str = dataclasses.field(
        default="lognormal:0.3", metadata={"argparse_meta": {"metavar": "SPEC"}}
    )
    """With --fake-process-group (one rank of a larger job on one GPU, docs/scale.md): what the
    emulated expert-parallel peers send this rank. lognormal:SKEW draws each expert's popularity
    as exp(SKEW x N(0, 1)) per layer and microbatch (0: uniform routing); a path to a .json
    trace replays recorded counts."""


@dataclass(frozen=True)
class PagingConfig:
    """What a paging run does. Field by field:

    page_size: rows per page (``--moe-paged-stash-page-size``).
    cuda_factor: device tier = ``|cuda_factor|`` x the calibrated peak rows in flight
        (``--moe-paged-stash-buffer-size-factor-cuda``). Megatron-Core's sign convention:
        positive sizes from the dispatcher's average-token hint where records carry one, else
        from the measured peak; negative always from the measured peak. Must not be 0.
    host_factor: pinned host tier, same convention; 0 = no host tier
        (``--moe-paged-stash-buffer-size-factor-cpu``).
    max_ctas: grid bound of the copy kernels (None: ``MEGATRON_PAGING_MAX_CTAS``, else 2048).
    overflow_policy: what a step whose pages overflowed does, as an :class:`OverflowPolicy`
        (:mod:`megatron_paging.overflow.policy`); :meth:`from_args` builds it from the name
        ``--paging-overflow-policy`` gives.
    prefetch_distance, hold_last_slot, offload_host_factor: the flags of the same names
        (:class:`PagingArgs`).
    offload_dma_prefix: the first rows of an offloaded live-row buffer that the copy engine moves
        (one DMA copy), as a fraction of the smallest live count calibration saw for that buffer
        shape; the kernels move the live rows past it. The Megatron adapter sets 1 when
        ``CUDA_DEVICE_MAX_CONNECTIONS`` allows more than one hardware queue (the copy engine
        then runs beside the compute without SMs), else 0 (docs/offload.md).
    offload_in_flight: inside a CUDA-graph capture, the compute stream waits on an offload's copy
        once more than this many groups of one module are in flight (Megatron-Core's
        ``--fine-grained-offloading-max-inflight-offloads``).
    pool_residency: ``step`` frees the device page tier between steps (the optimizer step gets
        its memory); ``persistent`` keeps it (what a captured CUDA graph needs). The adapter
        picks ``persistent`` under ``--cuda-graph-impl full_iteration``, else ``step``.
    kernel_backend: ``auto`` (CUDA kernels on CUDA tensors, else the reference), ``cuda``,
        ``tile``, ``bulk`` (one CUDA path forced) or ``reference`` (pure torch): tests and
        benchmarks choose; users keep ``auto``.
    overlap: False runs stash and reload on the compute stream (the no-overlap control of
        benchmarks).
    offload_streams: offloaded live rows page on one stream per offload pool (False: all on the
        paging stream, the benchmarks' control; docs/scheduler.md).
    stash_in_flight: at most this many layers' capacity-sized stash sources allocated at once,
        the opening layer's included (0: no bound; docs/scheduler.md).
    offload_d2h_max_ctas, offload_h2d_max_ctas: grid bounds of the kernels that move offloaded
        live rows to the host and back (PCIe bounds them, more CTAs only slow the compute).
    """

    page_size: int = 64
    cuda_factor: float = 1.10
    host_factor: float = 0.0
    max_ctas: int | None = None
    overflow_policy: OverflowPolicy = RerunPolicy()
    prefetch_distance: int = 1
    hold_last_slot: bool = False
    offload_host_factor: float = 1.25
    offload_dma_prefix: float = 0.0
    offload_in_flight: int = 2
    pool_residency: str = "persistent"
    kernel_backend: str = "auto"
    overlap: bool = True
    offload_streams: bool = True
    stash_in_flight: int = 1
    offload_d2h_max_ctas: int = 4
    offload_h2d_max_ctas: int = 8

    def __post_init__(self):
        positive_int("page_size", self.page_size)
        if _number("cuda_factor", self.cuda_factor) == 0:
            raise ConfigError("cuda_factor", "must be non-zero (it sizes the device page tier)")
        _number("host_factor", self.host_factor)
        kernel_grid_bound(self.max_ctas)
        if not isinstance(self.overflow_policy, OverflowPolicy):
            raise ConfigError(
                "overflow_policy",
                f"must be an OverflowPolicy (from_args builds it from a name), got "
                f"{self.overflow_policy!r}",
            )
        non_negative_int("prefetch_distance", self.prefetch_distance)
        for name in ("overlap", "hold_last_slot", "offload_streams"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be True or False, got {getattr(self, name)!r}")
        if _number("offload_host_factor", self.offload_host_factor) < 1:
            raise ConfigError(
                "offload_host_factor", f"must be >= 1, got {self.offload_host_factor!r}"
            )
        if not 0 <= _number("offload_dma_prefix", self.offload_dma_prefix) <= 1:
            raise ConfigError(
                "offload_dma_prefix", f"must be in [0, 1], got {self.offload_dma_prefix!r}"
            )
        non_negative_int("offload_in_flight", self.offload_in_flight)
        _choice("pool_residency", self.pool_residency, POOL_RESIDENCIES)
        _choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        non_negative_int("stash_in_flight", self.stash_in_flight)
        check_grid_bound("offload_d2h_max_ctas", self.offload_d2h_max_ctas)
        check_grid_bound("offload_h2d_max_ctas", self.offload_h2d_max_ctas)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields) -> "PagingConfig":
        """A config whose unset ``max_ctas`` comes from ``MEGATRON_PAGING_MAX_CTAS``."""
        if fields.get("max_ctas") is None:
            fields["max_ctas"] = max_ctas_from_env(environ)
        return cls(**fields)

    @classmethod
    def from_args(cls, args: PagingArgs, **fields) -> "PagingConfig":
        """A config with the flags of ``args`` (``paging_<name>`` -> ``<name>``; the overflow
        policy's name becomes its :class:`OverflowPolicy`) and ``fields``."""
        for flag in dataclasses.fields(PagingArgs):
            name = flag.name.removeprefix("paging_")
            if name in _CONFIG_FIELDS and name not in fields:
                value = getattr(args, flag.name)
                fields[name] = _policy_named(value) if name == "overflow_policy" else value
        return cls(**fields)

    def replace(self, **changes) -> "PagingConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def grid_bound(self) -> int:
        """The grid bound the copy kernels use."""
        return kernel_grid_bound(self.max_ctas)


def _policy_named(name: str) -> OverflowPolicy:
    _choice("overflow_policy", name, OVERFLOW_POLICIES)
    return POLICIES[name]()


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(PagingConfig))

__all__ = [
    "ConfigError",
    "DEFAULT_MAX_CTAS",
    "KERNEL_BACKENDS",
    "MAX_CTAS_ENV",
    "MAX_GRID_BOUND",
    "OFFLOAD_BACKENDS",
    "OVERFLOW_POLICIES",
    "POOL_RESIDENCIES",
    "PagingArgs",
    "PagingConfig",
    "check_grid_bound",
    "kernel_grid_bound",
    "max_ctas_from_env",
    "non_negative_int",
    "positive_int",
]
