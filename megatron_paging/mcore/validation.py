"""Megatron's ``validate_args`` and ``TransformerConfig`` before Megatron starts, as the run
applies them.

The plan (:mod:`megatron_paging.mcore.plan_inputs`) and the example's preflight
(``examples/preflight.py``) both need Megatron's own verdict on a launch line before anything is
built: the plan to read the layout Megatron derives, the preflight so that a layout Megatron
refuses is one line before torchrun starts rather than a traceback per rank. Both run it through
the lifts the example's run applies (the static dispatcher under ``--fake-process-group``,
offloading on the local spec), so neither refuses a line the run accepts. The preflight also
builds the model's ``TransformerConfig`` (:func:`validate_config`): its own checks (MoE,
offloading, recompute) would otherwise end the run only when the model is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import traceback
import warnings

from megatron_paging.mcore.dispatcher import STATIC_BACKEND

CONFIG_MODULE = "megatron.core.transformer.transformer_config"

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


def refusal_line(error: BaseException) -> str:
    """The first line of Megatron's refusal; for a bare ``assert`` (no message, as most of
    validate_args' are), the assertion's own source line and where it is."""
    message = str(error).strip()
    if message:
        return message.splitlines()[0]
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return repr(error)
    where = frames[-1]
    path = where.filename.replace(os.sep, "/")
    short = path[path.rfind("megatron/"):] if "megatron/" in path else os.path.basename(path)
    return f"{(where.line or repr(error)).strip()} ({short}:{where.lineno})"


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
        raise ValueError(f"Megatron's validate_args: {refusal_line(error)}") from None
    return args


def static_backend_post_init(original_post_init):
    """Wrap ``TransformerConfig.__post_init__`` so it accepts ``moe_flex_dispatcher_backend =
    'static'`` (``install()`` does; :func:`config_shims` for a config built before it).

    Megatron-Core 0.19.2 accepts ``moe_expert_rank_capacity_factor`` (required by
    ``moe_paged_stash``) only with the ``hybridep`` backend plus the TE op fuser, or ``ncclep``.
    Our ``static`` backend honours the same contract as those (a static permuted-token budget,
    device-side counts, an over-budget flag) in plain PyTorch, so it is validated under
    ``ncclep``'s rules (the ones without a TE requirement) and the name is restored after.
    """

    @functools.wraps(original_post_init)
    def __post_init__(self):
        if getattr(self, "moe_flex_dispatcher_backend", None) != STATIC_BACKEND:
            return original_post_init(self)
        if self.moe_token_dispatcher_type != "flex":
            raise ValueError(
                f"moe_flex_dispatcher_backend='{STATIC_BACKEND}' requires "
                f"moe_token_dispatcher_type='flex', got {self.moe_token_dispatcher_type!r}"
            )
        self.moe_flex_dispatcher_backend = "ncclep"
        try:
            return original_post_init(self)
        finally:
            self.moe_flex_dispatcher_backend = STATIC_BACKEND

    __post_init__.megatron_paging_shim = True
    return __post_init__


@contextlib.contextmanager
def config_shims(offload_backend: str | None = None):
    """``TransformerConfig.__post_init__`` as ``install()`` leaves it for ``offload_backend``
    (the static backend; the paged offloading backend's lift of expert modules), restored
    after."""
    from megatron_paging.mcore.offloading.shims import lifted_post_init

    config_cls = importlib.import_module(CONFIG_MODULE).TransformerConfig
    original = config_cls.__dict__["__post_init__"]
    post_init = static_backend_post_init(original)
    if offload_backend == "paged":
        post_init = lifted_post_init(post_init)
    config_cls.__post_init__ = post_init
    try:
        yield
    finally:
        config_cls.__post_init__ = original


def validate_config(args, offload_backend: str | None = None):
    """The model's ``TransformerConfig`` from validated ``args``, built as the run's model
    provider builds it (``core_transformer_config_from_args``, under :func:`config_shims`). A
    refusal is one ``ValueError`` line ("Megatron's TransformerConfig: ..."); returns the
    config."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import core_transformer_config_from_args

    try:
        with config_shims(offload_backend), warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return core_transformer_config_from_args(args)
    except (AssertionError, ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        raise ValueError(f"Megatron's TransformerConfig: {refusal_line(error)}") from None


__all__ = ["CONFIG_MODULE", "TARGET_CAPABILITY", "config_shims", "refusal_line",
           "static_backend_post_init", "target_device", "validate", "validate_config"]
