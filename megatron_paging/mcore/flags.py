"""Megatron's command line -> one :class:`~megatron_paging.config.PagingConfig`.

:func:`add_paging_args` is Megatron's ``extra_args_provider``: it adds the flags of
:class:`~megatron_paging.config.PagingArgs` (one field, one flag, help from the field's docstring,
through Megatron's own ``ArgumentGroupFactory``), adds ``static`` to the choices of
``--moe-flex-dispatcher-backend`` (our sync-free dispatch backend, :mod:`.dispatcher`), and mends
Megatron-Core help strings argparse cannot format. Megatron-Core's ``--moe-paged-stash*`` flags
are its own; they are added here only to a parser that lacks them (a bare parser in tools).

:func:`paging_config` validates everything once, before any model is built, and raises one
``ValueError`` naming the flags for a bad value or a meaningless or conflicting combination (the
refusals of Megatron features live in :mod:`.flag_checks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re

from megatron_paging.config import (
    MAX_CTAS_ENV,
    ConfigError,
    PagingArgs,
    PagingConfig,
    max_ctas_from_env,
)
from megatron_paging.mcore.dispatcher import STATIC_BACKEND
from megatron_paging.mcore.flag_checks import (
    check_delay_wgrad,
    check_fake_process_group,
    check_megatron_combinations,
    check_offload,
    check_offload_modules,
    check_recompute_expert_fc1,
    check_recompute_modules,
    check_static_backend,
    pool_residency,
)

# Megatron-Core's own flags (added only when the parser lacks them): flag -> add_argument kwargs.
MCORE_FLAGS = {
    "--moe-paged-stash": dict(action="store_true", help="page routed-expert activations"),
    "--moe-paged-stash-page-size": dict(type=int, default=64, help="rows per page"),
    "--moe-paged-stash-buffer-size-factor-cuda": dict(
        type=float, default=1.10,
        help="device page tier = |factor| x the calibrated peak rows in flight (positive: from "
        "the dispatcher's average-token hint, negative: from the measured peak)",
    ),
    "--moe-paged-stash-buffer-size-factor-cpu": dict(
        type=float, default=0.0, help="pinned host page tier, same convention (0: none)"
    ),
    "--moe-expert-rank-capacity-factor": dict(
        type=float, default=None, help="static per-rank permuted-token budget factor"
    ),
}
# PagingConfig fields that Megatron's flags set (errors name the flag).
MCORE_FLAG_OF_FIELD = {
    "page_size": "--moe-paged-stash-page-size",
    "cuda_factor": "--moe-paged-stash-buffer-size-factor-cuda",
    "host_factor": "--moe-paged-stash-buffer-size-factor-cpu",
    "offload_in_flight": "--fine-grained-offloading-max-inflight-offloads",
}
PAGING_ARGS = {f.name: f for f in dataclasses.fields(PagingArgs)}
# Flags that also act without paging (they build the unpaged control's model too).
WITHOUT_PAGING = ("paging_recompute_expert_fc1", "paging_offload_backend", "paging_emulated_load")
OFFLOAD_ONLY = ("paging_offload_host_factor",)


def flag_name(dest: str) -> str:
    """``paging_overflow_policy`` -> ``--paging-overflow-policy``."""
    return "--" + dest.replace("_", "-")


def flag_of_field(field: str) -> str:
    """The flag (or variable) behind a PagingConfig field, for error messages."""
    if "paging_" + field in PAGING_ARGS:
        return flag_name("paging_" + field)
    return MCORE_FLAG_OF_FIELD.get(field, field)


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


def _escape_percent(text: str) -> str:
    # argparse formats help with ``%``: keep ``%%`` and ``%(name)s``, escape a lone ``%``.
    return re.sub(r"%%|%\(|%", lambda m: m.group() if m.group() != "%" else "%%", text)


def mend_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Escape lone ``%`` in every option's help: Megatron-Core 0.19.2's help of
    ``--moe-paged-stash-buffer-size-factor-cuda`` holds one, and ``--help`` then raises."""
    for action in parser._actions:
        if isinstance(action.help, str) and "%" in action.help:
            action.help = _escape_percent(action.help)
    return parser


def add_paging_group(parser: argparse.ArgumentParser, include=None):
    """The :class:`PagingArgs` flags (those of the fields in ``include``, default all) as one
    argument group, through Megatron's ``ArgumentGroupFactory``; returns the group."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    exclude = None if include is None else [name for name in PAGING_ARGS if name not in include]
    return ArgumentGroupFactory(PagingArgs, exclude=exclude).build_group(
        parser, title="megatron-paging"
    )


def add_paging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add megatron-paging's flags; returns the parser."""
    group = add_paging_group(parser)
    for flag, kwargs in MCORE_FLAGS.items():
        if _option(parser, flag) is None:
            group.add_argument(flag, **kwargs)
    allow_static_backend(parser, group)
    return mend_help(parser)


def paging_args(args) -> PagingArgs:
    """The :class:`PagingArgs` part of a Megatron namespace (defaults where a flag is absent)."""
    return PagingArgs(**{name: getattr(args, name) for name in PAGING_ARGS if hasattr(args, name)})


def _listed(flags: list[str]) -> str:
    verb = "applies" if len(flags) == 1 else "apply"
    return f"{', '.join(flags)} only {verb}"


def paging_config(
    args,
    environ=None,
    cuda_available: bool | None = None,
    te_available: bool | None = None,
    mcore_manager: bool = False,
) -> PagingConfig:
    """The run's :class:`PagingConfig` from Megatron's ``args``; one ``ValueError`` naming the
    flags (or the environment variable) for a bad value or a meaningless combination.

    ``mcore_manager``: Megatron-Core's own paged-stash manager pages instead of ours (benchmarks
    compare against it, ``examples/``): our engine's refusals of Megatron features do not apply.
    """
    environ = os.environ if environ is None else environ
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if te_available is None:
        te_available = importlib.util.find_spec("transformer_engine") is not None
    ours = paging_args(args)
    stash = bool(getattr(args, "moe_paged_stash", False))
    offload = ours.paging_offload_backend == "paged" and bool(
        getattr(args, "fine_grained_activation_offloading", False)
    )
    changed = [
        name for name, f in PAGING_ARGS.items() if getattr(ours, name) != f.default
    ]
    if ours.paging_offload_backend == "paged" and not offload:
        check_offload(args)  # says what the paged backend needs
    offload_set = [flag_name(n) for n in changed if n in OFFLOAD_ONLY]
    if offload_set and not offload:
        raise ValueError(f"{_listed(offload_set)} with --paging-offload-backend paged")
    need_paging = [flag_name(n) for n in changed if n not in WITHOUT_PAGING]
    if need_paging and not (stash or offload):
        raise ValueError(
            f"{_listed(need_paging)} with --moe-paged-stash or --paging-offload-backend paged"
        )
    if mcore_manager and offload:
        raise ValueError(
            "--paging-offload-backend paged runs on megatron-paging's runtime, not on "
            "Megatron-Core's own paged-stash manager"
        )
    if getattr(args, "fake_process_group", False):
        check_fake_process_group(args)
    elif "paging_emulated_load" in changed:
        raise ValueError("--paging-emulated-load only applies with --fake-process-group")
    check_offload_modules(args, te_available)
    if offload:
        check_offload(args)
    check_recompute_expert_fc1(args)
    check_recompute_modules(args, te_available)
    check_delay_wgrad(args)
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if backend == STATIC_BACKEND and getattr(args, "moe_token_dispatcher_type", None) != "flex":
        raise ValueError(
            f"--moe-flex-dispatcher-backend {STATIC_BACKEND} needs --moe-token-dispatcher-type "
            f"flex (got {getattr(args, 'moe_token_dispatcher_type', None)!r})"
        )
    if backend == STATIC_BACKEND:
        check_static_backend(args)
    if stash:
        check_megatron_combinations(args, refuse_recompute=not mcore_manager)
    if not (stash or offload) or mcore_manager:
        return PagingConfig()  # our engine pages nothing: the environment is not read
    try:
        graphed = getattr(args, "cuda_graph_impl", "none") == "full_iteration"
        # One hardware queue serializes a DMA copy with the compute queued behind it; with more,
        # the copy engine moves offloaded rows beside the compute without taking SMs.
        queues = environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8").strip()
        in_flight = getattr(args, "fine_grained_offloading_max_inflight_offloads", None)
        return PagingConfig.from_args(
            ours,
            page_size=args.moe_paged_stash_page_size,
            cuda_factor=args.moe_paged_stash_buffer_size_factor_cuda,
            host_factor=args.moe_paged_stash_buffer_size_factor_cpu,
            max_ctas=max_ctas_from_env(environ),
            offload_dma_prefix=1.0 if offload and queues != "1" else 0.0,
            offload_in_flight=PagingConfig.offload_in_flight if in_flight is None else in_flight,
            pool_residency=pool_residency(graphed),
        )
    except ConfigError as error:
        if error.field == MAX_CTAS_ENV:
            raise
        raise ConfigError(flag_of_field(error.field), error.problem) from None


def offload_backend(args) -> str | None:
    """The offloading backend :func:`megatron_paging.mcore.install` installs for ``args``
    (``--paging-offload-backend`` when fine-grained offloading is on), else None."""
    if not getattr(args, "fine_grained_activation_offloading", False):
        return None
    return paging_args(args).paging_offload_backend


def install_options(args, config: PagingConfig | None = None, mcore_manager: bool = False) -> dict:
    """Keyword arguments of :func:`megatron_paging.mcore.install` from ``args`` and the config
    :func:`paging_config` built from them (none with Megatron-Core's own manager)."""
    options = {}
    if offload_backend(args) is not None:
        options["offload_backend"] = offload_backend(args)
    if getattr(args, "fake_process_group", False):
        from megatron_paging.mcore.peers import EmulatedPeers  # a diagnostic: imported here only
        from megatron_paging.tools.peer_load import parse_load

        seed = getattr(args, "seed", 0)
        options["peers"] = EmulatedPeers(
            parse_load(paging_args(args).paging_emulated_load, seed), seed)
    if mcore_manager:
        return dict(replace_paged_stash=False, **options)
    return dict(replace_paged_stash=True, config=config or paging_config(args), **options)


__all__ = [
    "MCORE_FLAGS",
    "PAGING_ARGS",
    "add_paging_args",
    "add_paging_group",
    "allow_static_backend",
    "flag_name",
    "flag_of_field",
    "install_options",
    "mend_help",
    "offload_backend",
    "paging_args",
    "paging_config",
]
