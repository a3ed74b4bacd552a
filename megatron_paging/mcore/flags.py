"""Command-line flags for Megatron's ``extra_args_provider``, and the one place they become a
:class:`~megatron_paging.config.PagingConfig`.

Megatron-Core 0.19.2 already defines (from ``TransformerConfig`` fields) and we keep, unchanged:
``--moe-paged-stash``, ``--moe-paged-stash-page-size`` (64),
``--moe-paged-stash-buffer-size-factor-cuda`` (1.10), ``--moe-paged-stash-buffer-size-factor-cpu``
(0.0) and ``--moe-expert-rank-capacity-factor``. :func:`add_paging_args` adds them only to a
parser that lacks them (a bare parser in tests or tools), and adds ours: ``OUR_FLAGS`` below,
each with its default (``PAGING_DEFAULTS``) and help; docs/mcore.md's flag table explains every
one.

It also adds ``static`` to the choices of Megatron's ``--moe-flex-dispatcher-backend`` (our
sync-free dispatch backend, :mod:`.dispatcher`).

:func:`paging_config` validates everything once and raises one ``ValueError`` naming the
offending flags for every meaningless or conflicting combination, before any model is built:
``--paging-*`` flags other than ``--paging-gemm-backend``, ``--paging-core-attention``,
``--paging-sdpa-backend``, ``--paging-recompute-expert-fc1``, ``--paging-keep-ddp-side-stream``
and ``--paging-offload-backend`` need ``--moe-paged-stash`` or ``--paging-offload-backend
paged`` (those build the unpaged control's model too);
``--paging-offload-*`` need ``--paging-offload-backend paged``, which needs
``--fine-grained-activation-offloading`` and refuses what it cannot serve (per-layer CUDA graphs,
``--delay-offload-until-cuda-graph``, ``--fine-grained-offloading-max-inflight-offloads``
without full-iteration graphs, ``fused_group_mlp``, ``--paging-implementation mcore``, expert
modules without ``--moe-expert-rank-capacity-factor``); ``--paging-sdpa-backend`` needs
``--paging-core-attention sdpa``, and its ``cudnn`` is refused with ``--deterministic-mode``;
``--paging-implementation mcore`` rejects the
flags only our engine and runner read; Megatron features that cannot run with paging (per-layer
CUDA graphs) or leave it nothing to page (a recompute of every MoE layer) are refused by
name. Paged or not, ``--recompute-granularity selective`` with a ``--recompute-modules`` entry
that Megatron-Core runs through ``CheckpointWithoutOutput`` is refused when Transformer Engine
is not installed. The refusals live in :mod:`.flag_checks`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

from megatron_paging.config import (
    MAX_CTAS_ENV,
    POOL_RESIDENCIES,
    PREFETCH_POINTS,
    STASH_POINTS,
    ConfigError,
    PagingConfig,
    kernel_backend_choices,
    max_ctas_from_env,
    overflow_policy_choices,
)
from megatron_paging.kernels import REGISTRY
from megatron_paging.mcore.attention import CORE_ATTENTIONS, SDPA_BACKENDS
from megatron_paging.mcore.dispatcher import STATIC_BACKEND
from megatron_paging.mcore.experts import GEMM_BACKENDS
from megatron_paging.mcore.flag_checks import (
    CORE_ATTENTION_DEFAULT,
    SDPA_BACKEND_DEFAULT,
    check_core_attention,
    check_megatron_combinations,
    check_offload,
    check_prefetch_point,
    check_recompute_expert_fc1,
    check_recompute_modules,
    pool_residency,
)

# Megatron-Core's own flags (added only when the parser lacks them): flag -> add_argument kwargs.
MCORE_FLAGS = {
    "--moe-paged-stash": dict(action="store_true", help="page routed-expert activations"),
    "--moe-paged-stash-page-size": dict(type=int, default=64, help="rows per page"),
    "--moe-paged-stash-buffer-size-factor-cuda": dict(
        type=float, default=1.10,
        help="CUDA tier size = |factor| x calibrated peak rows (positive: average-token peak, "
        "negative: measured peak)",
    ),
    "--moe-paged-stash-buffer-size-factor-cpu": dict(
        type=float, default=0.0, help="pinned host tier size, same convention (0: none)"
    ),
    "--moe-expert-rank-capacity-factor": dict(
        type=float, default=None, help="static per-rank permuted-token budget factor"
    ),
}

# Our flags: dest -> default (validation compares against these to see what was set).
PAGING_DEFAULTS = {
    "paging_max_ctas": None,
    "paging_prefetch_distance": 1,
    "paging_prefetch_point": "experts",
    "paging_stash_point": "commit",
    "paging_no_overlap": False,
    "paging_overflow_policy": "rerun",
    "paging_growth_factor": 1.5,
    "paging_kernel_backend": "auto",
    "paging_gemm_backend": "auto",
    "paging_implementation": "ours",
    "paging_core_attention": CORE_ATTENTION_DEFAULT,
    "paging_sdpa_backend": SDPA_BACKEND_DEFAULT,
    "paging_offload_backend": "mcore",
    "paging_offload_host_factor": 1.25,
    "paging_offload_max_ctas": [4, 8],  # D2H, H2D
    "paging_offload_dma_prefix": 0.0,
    "paging_pool_residency": "auto",
    "paging_hold_last_slot": False,
    "paging_max_inflight_stashes": 1,
    "paging_recompute_expert_fc1": False,
    "paging_recompute_expert_fc1_piece_rows": 0,
    "paging_keep_ddp_side_stream": False,
}
IMPLEMENTATIONS = ("ours", "mcore")
OFFLOAD_BACKENDS = ("mcore", "paged")
# Flags that also act without --moe-paged-stash (they build the unpaged control's model too).
WITHOUT_PAGING = (
    "paging_gemm_backend", "paging_core_attention", "paging_sdpa_backend", "paging_offload_backend",
    "paging_recompute_expert_fc1", "paging_recompute_expert_fc1_piece_rows",
    "paging_keep_ddp_side_stream",
)
OFFLOAD_ONLY = (
    "paging_offload_host_factor", "paging_offload_max_ctas", "paging_offload_dma_prefix"
)
# Flags of our engine and runner; Megatron-Core's own manager (`mcore`) ignores them.
OURS_ONLY = (
    "paging_kernel_backend",
    "paging_prefetch_distance",
    "paging_prefetch_point",
    "paging_stash_point",
    "paging_no_overlap",
    "paging_max_ctas",
    "paging_overflow_policy",
    "paging_growth_factor",
    "paging_pool_residency",
    "paging_hold_last_slot",
    "paging_max_inflight_stashes",
)
# PagingConfig field -> the flag that sets it (errors name the flag).
FLAG_OF_FIELD = {
    "page_size": "--moe-paged-stash-page-size",
    "cuda_factor": "--moe-paged-stash-buffer-size-factor-cuda",
    "host_factor": "--moe-paged-stash-buffer-size-factor-cpu",
    "kernel_backend": "--paging-kernel-backend",
    "max_ctas": "--paging-max-ctas",
    "prefetch_distance": "--paging-prefetch-distance",
    "prefetch_point": "--paging-prefetch-point",
    "stash_point": "--paging-stash-point",
    "overlap": "--paging-no-overlap",
    "overflow_policy": "--paging-overflow-policy",
    "growth_factor": "--paging-growth-factor",
    "offload_host_factor": "--paging-offload-host-factor",
    "offload_d2h_max_ctas": "--paging-offload-max-ctas",
    "offload_h2d_max_ctas": "--paging-offload-max-ctas",
    "offload_dma_prefix": "--paging-offload-dma-prefix",
    "offload_in_flight": "--fine-grained-offloading-max-inflight-offloads",
    "pool_residency": "--paging-pool-residency",
    "hold_last_slot": "--paging-hold-last-slot",
    "stash_in_flight": "--paging-max-inflight-stashes",
}
# Our flags: dest -> add_argument keywords (the default comes from PAGING_DEFAULTS).
OUR_FLAGS = {
    "paging_max_ctas": dict(
        type=int, help=f"grid bound of the paging copy kernels (default: ${MAX_CTAS_ENV} or 2048)"
    ),
    "paging_prefetch_distance": dict(
        type=int, help="reload this many later-backward layers together with the current one"
    ),
    "paging_prefetch_point": dict(
        choices=PREFETCH_POINTS,
        help="where a layer's backward ends and the layers below are reloaded: after its "
        "experts' backward (experts) or after the static dispatcher's (dispatcher: the "
        "reloads then run beside the attention's backward, not the dispatcher's gathers)",
    ),
    "paging_stash_point": dict(
        choices=STASH_POINTS,
        help="when a committed layer is stashed: at once (commit) or when the next layer's "
        "experts begin (next-layer: the copies run beside its GEMMs; the newest layer is held "
        "as with --paging-hold-last-slot)",
    ),
    "paging_no_overlap": dict(
        action="store_true", help="run stash and reload on the compute stream (no-overlap control)"
    ),
    "paging_overflow_policy": dict(
        choices=overflow_policy_choices(), help="what a step whose pages overflowed does"
    ),
    "paging_growth_factor": dict(
        type=float, help="device-tier multiplier of --paging-overflow-policy grow"
    ),
    "paging_kernel_backend": dict(
        choices=kernel_backend_choices(),
        help="stash/reload kernels: CUDA (bulk or tile path per record), one path forced, "
        "pure-torch reference, or auto",
    ),
    "paging_gemm_backend": dict(
        choices=GEMM_BACKENDS,
        help="PagedGroupedMLP GEMMs: torch._grouped_mm, a per-expert loop, or auto",
    ),
    "paging_implementation": dict(
        choices=IMPLEMENTATIONS,
        help="page through megatron-paging (ours) or Megatron-Core's own manager (mcore)",
    ),
    "paging_core_attention": dict(
        choices=CORE_ATTENTIONS,
        help="core attention of the local spec: fused torch SDPA (sdpa, no [b, heads, s, s] "
        "activations) or Megatron's unfused DotProductAttention (local)",
    ),
    "paging_sdpa_backend": dict(
        choices=SDPA_BACKENDS,
        help="SDPA backend pinned by --paging-core-attention sdpa (auto: flash on CUDA "
        "fp16/bf16, efficient on CUDA fp32, math on CPU; cudnn is refused with "
        "--deterministic-mode)",
    ),
    "paging_offload_backend": dict(
        choices=OFFLOAD_BACKENDS,
        help="backend of --fine-grained-activation-offloading: Megatron-Core's (mcore) or "
        "megatron-paging's (paged: live expert rows through the page kernels, dense tensors by "
        "DMA into one pinned arena, on the paging stream)",
    ),
    "paging_offload_host_factor": dict(
        type=float,
        help="offload host tier = this x the calibrated peak of offloaded live rows (>= 1)",
    ),
    "paging_offload_max_ctas": dict(
        type=int, nargs="+", metavar="N",
        help="grid bounds of the copy kernels for offloaded live rows (PCIe-bound): D2H H2D, "
        "or one value for both (default 4 8: D2H saturates PCIe with 4 CTAs on the H200, H2D "
        "needs 8, and every CTA more slows the compute beside it)",
    ),
    "paging_offload_dma_prefix": dict(
        type=float, metavar="FRACTION",
        help="offloaded live rows: the copy engine moves the first FRACTION x (the smallest "
        "live count calibration saw for that buffer shape) rows, the kernels only the rest "
        "(no SMs for most of the PCIe traffic; 0 = all through the kernels)",
    ),
    "paging_pool_residency": dict(
        choices=("auto", *POOL_RESIDENCIES),
        help="device page tier: freed between steps so the optimizer step can use its memory "
        "(step), kept for the run (persistent, what a captured CUDA graph needs), or auto "
        "(persistent with --cuda-graph-impl full_iteration, else step)",
    ),
    "paging_hold_last_slot": dict(
        action="store_true", help="stash a layer only once the next one commits: the last layer "
        "before a backward is never copied, and the pool is sized without it",
    ),
    "paging_max_inflight_stashes": dict(
        type=int, help="at most this many layers' capacity-sized stash inputs allocated at "
        "once: when a layer's experts begin, older layers' inputs go, after the compute "
        "stream waits on copies not yet seen done (never the host); 0 = no bound",
    ),
    "paging_recompute_expert_fc1": dict(
        action="store_true", help="PagedGroupedMLP saves only its input and recomputes fc1 in "
        "backward (one grouped GEMM): paging, offloading (--offload-modules expert_fc1) or "
        "autograd keep x instead of the wider fc1; gradients bitwise unchanged",
    ),
    "paging_recompute_expert_fc1_piece_rows": dict(
        type=int, metavar="ROWS", help="run the fc1 recompute's unfused weighted activation "
        "(--no-bias-swiglu-fusion) in pieces of ROWS rows (0: whole): its fp32 temporaries, "
        "which set the backward's peak, shrink to a piece; more launches (moe_compute, 16384: "
        "3553 MiB less activation, +8%% step time)",
    ),
    "paging_keep_ddp_side_stream": dict(
        action="store_true", help="build DDP on Megatron's side stream, as Megatron does: its "
        "gradient accumulators then run there, so each weight gradient stays allocated until "
        "the GPU reaches it (default: build DDP on the training stream)",
    ),
}


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
    for dest, kwargs in OUR_FLAGS.items():
        group.add_argument("--" + dest.replace("_", "-"), default=PAGING_DEFAULTS[dest], **kwargs)
    return parser


def paging_config(
    args, environ=None, cuda_available: bool | None = None, te_available: bool | None = None
) -> PagingConfig:
    """The run's :class:`PagingConfig` from ``args``; one ``ValueError`` naming the flags (or the
    environment variable) for a bad value or a meaningless combination."""
    environ = os.environ if environ is None else environ
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if te_available is None:
        te_available = importlib.util.find_spec("transformer_engine") is not None
    stash = bool(getattr(args, "moe_paged_stash", False))
    offload = getattr(args, "paging_offload_backend", "mcore") == "paged"
    paged = stash or offload
    ours_set = {
        dest: "--" + dest.replace("_", "-")
        for dest, default in PAGING_DEFAULTS.items()
        if getattr(args, dest, default) != default
    }
    offload_set = [flag for dest, flag in ours_set.items() if dest in OFFLOAD_ONLY]
    if offload_set and not offload:
        raise ValueError(f"{', '.join(offload_set)} only apply with --paging-offload-backend paged")
    need_paging = [flag for dest, flag in ours_set.items() if dest not in WITHOUT_PAGING]
    if need_paging and not paged:
        raise ValueError(
            f"{', '.join(need_paging)} only apply with --moe-paged-stash or "
            "--paging-offload-backend paged"
        )
    if offload:
        check_offload(args)
    if getattr(args, "paging_implementation", "ours") == "mcore":
        unused = [flag for dest, flag in ours_set.items() if dest in OURS_ONLY]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} have no effect with --paging-implementation mcore "
                "(Megatron-Core's own paged-stash manager, kernels and step runner)"
            )

    check_core_attention(args)
    check_recompute_expert_fc1(args)
    check_prefetch_point(args)
    check_recompute_modules(args, te_available)
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if backend == STATIC_BACKEND and getattr(args, "moe_token_dispatcher_type", None) != "flex":
        raise ValueError(
            f"--moe-flex-dispatcher-backend {STATIC_BACKEND} needs --moe-token-dispatcher-type "
            f"flex (got {getattr(args, 'moe_token_dispatcher_type', None)!r})"
        )
    if not paged:
        return PagingConfig()  # nothing pages: the environment is not read
    try:
        env_max_ctas = max_ctas_from_env(environ)
        if stash:
            check_megatron_combinations(args)
        max_ctas = args.paging_max_ctas
        if max_ctas is not None and env_max_ctas is not None and env_max_ctas != max_ctas:
            raise ValueError(
                f"--paging-max-ctas {max_ctas} conflicts with {MAX_CTAS_ENV}="
                f"{environ[MAX_CTAS_ENV]}; set one of them"
            )
        config = PagingConfig(
            page_size=args.moe_paged_stash_page_size,
            cuda_factor=args.moe_paged_stash_buffer_size_factor_cuda,
            host_factor=args.moe_paged_stash_buffer_size_factor_cpu,
            kernel_backend=args.paging_kernel_backend,
            max_ctas=env_max_ctas if max_ctas is None else max_ctas,
            prefetch_distance=args.paging_prefetch_distance,
            prefetch_point=getattr(args, "paging_prefetch_point", "experts"),
            stash_point=getattr(args, "paging_stash_point", "commit"),
            overlap=not args.paging_no_overlap,
            overflow_policy=args.paging_overflow_policy,
            growth_factor=args.paging_growth_factor,
            offload_host_factor=getattr(args, "paging_offload_host_factor", 1.25),
            **_offload_grids(args),
            offload_dma_prefix=getattr(args, "paging_offload_dma_prefix", 0.0),
            offload_in_flight=_in_flight(args),
            pool_residency=pool_residency(args),
            hold_last_slot=getattr(args, "paging_hold_last_slot", False),
            stash_in_flight=getattr(args, "paging_max_inflight_stashes", 1),
        )
    except ConfigError as error:
        raise ConfigError(*_flag_words(error)) from None
    backend = REGISTRY.get(config.kernel_backend)
    if backend is not None and "cpu" not in backend.device_types and not cuda_available:
        raise ValueError(
            f"--paging-kernel-backend {config.kernel_backend} needs a CUDA device (none is "
            "available)"
        )
    if config.offload_dma_prefix > 0 and environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        # Correct, but slow: with one hardware queue each DMA copy holds back the compute
        # queued behind it (moe_compute: 4538 ms per step against 3064 with 32 connections).
        logging.getLogger(__name__).warning(
            "--paging-offload-dma-prefix with CUDA_DEVICE_MAX_CONNECTIONS=1: the copy engine's "
            "copies serialize with the compute (docs/offload.md); set it to 8 or more if the "
            "run allows (tensor-parallel communication overlap needs 1)"
        )
    return config


def _offload_grids(args) -> dict[str, int]:
    """``--paging-offload-max-ctas D2H [H2D]`` as the two config fields (one value: both)."""
    values = getattr(args, "paging_offload_max_ctas", PAGING_DEFAULTS["paging_offload_max_ctas"])
    if isinstance(values, int):  # set programmatically as one number
        values = [values]
    if len(values) not in (1, 2):
        raise ValueError(
            f"--paging-offload-max-ctas takes one value (both directions) or two (D2H H2D), "
            f"got {len(values)}: {' '.join(map(str, values))}"
        )
    d2h, h2d = (values[0], values[0]) if len(values) == 1 else values
    return {"offload_d2h_max_ctas": d2h, "offload_h2d_max_ctas": h2d}


def _flag_words(error: ConfigError) -> tuple[str, str]:
    return FLAG_OF_FIELD.get(error.field, error.field), error.problem


def _in_flight(args) -> int:
    """Megatron-Core's in-flight cap for offloads under graphs; unset: 2 (docs/offload.md)."""
    value = getattr(args, "fine_grained_offloading_max_inflight_offloads", None)
    return PagingConfig.offload_in_flight if value is None else value


def validate_paging_args(
    args, environ=None, cuda_available: bool | None = None, te_available: bool | None = None
) -> None:
    """Raise ``ValueError`` (one message naming the flags) for a bad or meaningless setting."""
    paging_config(args, environ, cuda_available, te_available)


def install_options(args, config: PagingConfig | None = None) -> dict:
    """Keyword arguments of :func:`megatron_paging.mcore.install` from ``args`` and the config
    :func:`paging_config` built from them (none for ``mcore``: Megatron-Core's own manager has
    no use for one)."""
    # Both implementations: DDP's stream, and offloading's backend (absent: offloading off,
    # Megatron-Core's interface left alone).
    common = dict(ddp_on_training_stream=not getattr(args, "paging_keep_ddp_side_stream", False))
    if getattr(args, "fine_grained_activation_offloading", False):
        common["offload_backend"] = getattr(args, "paging_offload_backend", "mcore")
    if args.paging_implementation == "mcore":
        return dict(replace_paged_stash=False, **common)
    return dict(replace_paged_stash=True, config=config or paging_config(args), **common)


def apply_to_config(config, args) -> None:
    """Copy the flags Megatron's config builder does not know onto a ``TransformerConfig``
    (the step runner reads ``moe_paging_overflow_policy`` from it)."""
    config.moe_paging_overflow_policy = args.paging_overflow_policy


__all__ = [
    "MAX_CTAS_ENV",
    "PAGING_DEFAULTS",
    "add_paging_args",
    "apply_to_config",
    "install_options",
    "paging_config",
    "validate_paging_args",
]
