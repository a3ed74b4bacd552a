"""Command-line flags for Megatron's ``extra_args_provider`` and their start-up validation.

Megatron-Core 0.19.2 already defines (from ``TransformerConfig`` fields) and we keep, unchanged:
``--moe-paged-stash``, ``--moe-paged-stash-page-size`` (64),
``--moe-paged-stash-buffer-size-factor-cuda`` (1.10), ``--moe-paged-stash-buffer-size-factor-cpu``
(0.0) and ``--moe-expert-rank-capacity-factor``. :func:`add_paging_args` adds them only to a
parser that lacks them (a bare parser in tests or tools), and adds ours:

==============================  ========  ===================================================
flag                            default   meaning
==============================  ========  ===================================================
``--paging-max-ctas``           None      grid bound of the copy kernels (None: the
                                          ``MEGATRON_PAGING_MAX_CTAS`` environment, else 2048)
``--paging-prefetch-distance``  1         reload this many later-backward layers ahead
``--paging-overflow-policy``    rerun     ``rerun`` | ``skip`` | ``grow`` (see overflow.py)
``--paging-kernel-backend``     auto      ``auto`` | ``cuda`` | ``reference``
``--paging-gemm-backend``       auto      PagedGroupedMLP GEMMs: ``auto`` | ``grouped`` |
                                          ``loop``
``--paging-implementation``     ours      ``ours`` | ``mcore``: page through megatron-paging,
                                          or through Megatron-Core's own manager and Triton
                                          kernels (the benchmark baseline; same model)
==============================  ========  ===================================================

It also adds ``static`` to the choices of Megatron's ``--moe-flex-dispatcher-backend`` (our
sync-free dispatch backend, :mod:`.dispatcher`).

:func:`validate_paging_args` raises one ``ValueError`` naming the offending flags for every
meaningless or conflicting combination, before any model is built: ``--paging-*`` flags other
than ``--paging-gemm-backend`` need ``--moe-paged-stash`` (the GEMM backend also selects the
unpaged control's GEMMs); ``--paging-implementation mcore`` rejects the flags only our engine
and runner read (kernel backend, prefetch distance, max CTAs, overflow policy).
"""

from __future__ import annotations

import argparse
import math
import os

from megatron_paging.kernels import BACKENDS as KERNEL_BACKENDS
from megatron_paging.mcore.dispatcher import STATIC_BACKEND
from megatron_paging.mcore.experts import GEMM_BACKENDS
from megatron_paging.overflow import POLICIES

MAX_CTAS_ENV = "MEGATRON_PAGING_MAX_CTAS"

# Megatron-Core's own flags (added only when the parser lacks them): flag -> add_argument kwargs.
MCORE_FLAGS = {
    "--moe-paged-stash": dict(action="store_true", help="page routed-expert activations"),
    "--moe-paged-stash-page-size": dict(type=int, default=64, help="rows per page"),
    "--moe-paged-stash-buffer-size-factor-cuda": dict(
        type=float, default=1.10, help="CUDA tier size = |factor| x calibrated peak rows"
    ),
    "--moe-paged-stash-buffer-size-factor-cpu": dict(
        type=float, default=0.0, help="pinned host tier size = |factor| x peak (0: none)"
    ),
    "--moe-expert-rank-capacity-factor": dict(
        type=float, default=None, help="static per-rank permuted-token budget factor"
    ),
}

# Our flags: dest -> default (validation compares against these to see what was set).
PAGING_DEFAULTS = {
    "paging_max_ctas": None,
    "paging_prefetch_distance": 1,
    "paging_overflow_policy": "rerun",
    "paging_kernel_backend": "auto",
    "paging_gemm_backend": "auto",
    "paging_implementation": "ours",
}
IMPLEMENTATIONS = ("ours", "mcore")
# Flags that also act without --moe-paged-stash (the GEMMs of the unpaged control run).
WITHOUT_PAGING = ("paging_gemm_backend",)
# Flags of our engine and runner; Megatron-Core's own manager (`mcore`) ignores them.
OURS_ONLY = (
    "paging_kernel_backend",
    "paging_prefetch_distance",
    "paging_max_ctas",
    "paging_overflow_policy",
)


def _option(parser: argparse.ArgumentParser, flag: str):
    return parser._option_string_actions.get(flag)


def allow_static_backend(parser: argparse.ArgumentParser, group=None) -> argparse.ArgumentParser:
    """Make ``--moe-flex-dispatcher-backend`` accept ``static`` (adding the flag if absent)."""
    backend = _option(parser, "--moe-flex-dispatcher-backend")
    if backend is None:
        (group or parser).add_argument(
            "--moe-flex-dispatcher-backend",
            choices=("deepep", "hybridep", "ncclep", STATIC_BACKEND),
            default="deepep",
        )
    elif backend.choices is not None and STATIC_BACKEND not in backend.choices:
        backend.choices = (*backend.choices, STATIC_BACKEND)
    return parser


def add_paging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add megatron-paging's flags; returns the parser."""
    group = parser.add_argument_group(title="megatron-paging")
    for flag, kwargs in MCORE_FLAGS.items():
        if _option(parser, flag) is None:
            group.add_argument(flag, **kwargs)
    allow_static_backend(parser, group)
    group.add_argument(
        "--paging-max-ctas",
        type=int,
        default=PAGING_DEFAULTS["paging_max_ctas"],
        help=f"grid bound of the paging copy kernels (default: ${MAX_CTAS_ENV} or 2048)",
    )
    group.add_argument(
        "--paging-prefetch-distance",
        type=int,
        default=PAGING_DEFAULTS["paging_prefetch_distance"],
        help="reload this many later-backward layers together with the current one",
    )
    group.add_argument(
        "--paging-overflow-policy",
        choices=POLICIES,
        default=PAGING_DEFAULTS["paging_overflow_policy"],
        help="what a step whose pages overflowed does",
    )
    group.add_argument(
        "--paging-kernel-backend",
        choices=KERNEL_BACKENDS,
        default=PAGING_DEFAULTS["paging_kernel_backend"],
        help="stash/reload kernels: CUDA extension, pure-torch reference, or auto",
    )
    group.add_argument(
        "--paging-gemm-backend",
        choices=GEMM_BACKENDS,
        default=PAGING_DEFAULTS["paging_gemm_backend"],
        help="PagedGroupedMLP GEMMs: torch._grouped_mm, a per-expert loop, or auto",
    )
    group.add_argument(
        "--paging-implementation",
        choices=IMPLEMENTATIONS,
        default=PAGING_DEFAULTS["paging_implementation"],
        help="page through megatron-paging (ours) or Megatron-Core's own manager (mcore)",
    )
    return parser


def _finite(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def validate_paging_args(args, environ=None, cuda_available: bool | None = None) -> None:
    """Raise ``ValueError`` (one message naming the flags) for a meaningless combination."""
    environ = os.environ if environ is None else environ
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    paged = bool(getattr(args, "moe_paged_stash", False))
    ours_set = {
        dest: "--" + dest.replace("_", "-")
        for dest, default in PAGING_DEFAULTS.items()
        if getattr(args, dest, default) != default
    }
    need_paging = [flag for dest, flag in ours_set.items() if dest not in WITHOUT_PAGING]
    if need_paging and not paged:
        raise ValueError(f"{', '.join(need_paging)} only apply with --moe-paged-stash")
    if getattr(args, "paging_implementation", "ours") == "mcore":
        unused = [flag for dest, flag in ours_set.items() if dest in OURS_ONLY]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} have no effect with --paging-implementation mcore "
                "(Megatron-Core's own paged-stash manager, kernels and step runner)"
            )

    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if backend == STATIC_BACKEND and getattr(args, "moe_token_dispatcher_type", None) != "flex":
        raise ValueError(
            f"--moe-flex-dispatcher-backend {STATIC_BACKEND} needs --moe-token-dispatcher-type "
            f"flex (got {getattr(args, 'moe_token_dispatcher_type', None)!r})"
        )
    if not paged:
        return

    page_size = args.moe_paged_stash_page_size
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"--moe-paged-stash-page-size must be a positive integer, got {page_size}")
    cuda_factor = _finite(
        "--moe-paged-stash-buffer-size-factor-cuda", args.moe_paged_stash_buffer_size_factor_cuda
    )
    if cuda_factor == 0:
        raise ValueError(
            "--moe-paged-stash-buffer-size-factor-cuda must be non-zero (it sizes the CUDA "
            "page tier from the calibrated peak; the sign is Megatron-Core's and ignored here)"
        )
    _finite("--moe-paged-stash-buffer-size-factor-cpu", args.moe_paged_stash_buffer_size_factor_cpu)
    rank_factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    if rank_factor is None:
        raise ValueError(
            "--moe-paged-stash needs --moe-expert-rank-capacity-factor (the static expert "
            "capacity that paging shrinks to live rows)"
        )
    if _finite("--moe-expert-rank-capacity-factor", rank_factor) <= 0:
        raise ValueError(f"--moe-expert-rank-capacity-factor must be > 0, got {rank_factor}")

    max_ctas = args.paging_max_ctas
    if max_ctas is not None:
        if max_ctas <= 0:
            raise ValueError(f"--paging-max-ctas must be a positive integer, got {max_ctas}")
        env_value = environ.get(MAX_CTAS_ENV)
        if env_value is not None and env_value.strip() != str(max_ctas):
            raise ValueError(
                f"--paging-max-ctas {max_ctas} conflicts with {MAX_CTAS_ENV}={env_value}; "
                "set one of them"
            )
    if args.paging_prefetch_distance < 0:
        raise ValueError(
            f"--paging-prefetch-distance must be >= 0, got {args.paging_prefetch_distance}"
        )
    if args.paging_kernel_backend == "cuda" and not cuda_available:
        raise ValueError("--paging-kernel-backend cuda needs a CUDA device (none is available)")


def install_options(args) -> dict:
    """Keyword arguments of :func:`megatron_paging.mcore.install.install` from ``args``
    (no engine options for ``mcore``: Megatron-Core's own manager has no use for them)."""
    if args.paging_implementation == "mcore":
        return dict(replace_paged_stash=False)
    return dict(replace_paged_stash=True, **engine_options(args))


def engine_options(args) -> dict:
    """Keyword arguments of :class:`~megatron_paging.mcore.engine.PagingEngine` from ``args``."""
    return dict(
        kernel_backend=args.paging_kernel_backend,
        prefetch_distance=args.paging_prefetch_distance,
        max_ctas=args.paging_max_ctas,
    )


def apply_to_config(config, args) -> None:
    """Copy the flags Megatron's config builder does not know onto a ``TransformerConfig``
    (the step runner reads ``moe_paging_overflow_policy`` from it)."""
    config.moe_paging_overflow_policy = args.paging_overflow_policy


__all__ = [
    "MAX_CTAS_ENV",
    "PAGING_DEFAULTS",
    "add_paging_args",
    "apply_to_config",
    "engine_options",
    "install_options",
    "validate_paging_args",
]
