"""The example's start-up checks, before Megatron starts: a GPU, the paging flags, the benchmark
controls. A refusal is one ``error: ...`` line on stderr and exit status 2.

``examples/run_pretrain_1gpu.sh`` runs ``python examples/preflight.py <the example's flags>``
before ``torchrun`` (so a refusal is the last line printed, not buried under torchrun's report);
``pretrain_gpt_moe_paged.py`` calls :func:`check` again when started some other way.

Benchmark controls: environment variables read only by ``examples/`` and ``benchmarks/``
(docs/benchmarks.md), never by the library:

=====================================  ==========================================================
``MEGATRON_PAGING_BENCH_IMPLEMENTATION``  ``ours`` (default) or ``mcore``: Megatron-Core's own
                                          paged-stash manager, kernels and step runner page
                                          instead (the baseline benchmarks compare against)
``MEGATRON_PAGING_BENCH_KERNEL_BACKEND``  ``auto`` (default), ``cuda``, ``tile``, ``bulk``,
                                          ``reference``: the copy kernels
``MEGATRON_PAGING_BENCH_NO_OVERLAP``      ``1``: stash and reload on the compute stream
``MEGATRON_PAGING_BENCH_MEMORY_FRACTION`` a fraction in (0, 1]: the process's memory cap
                                          (``torch.cuda.set_per_process_memory_fraction``)
=====================================  ==========================================================
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

IMPLEMENTATION_ENV = "MEGATRON_PAGING_BENCH_IMPLEMENTATION"
KERNEL_BACKEND_ENV = "MEGATRON_PAGING_BENCH_KERNEL_BACKEND"
NO_OVERLAP_ENV = "MEGATRON_PAGING_BENCH_NO_OVERLAP"
MEMORY_FRACTION_ENV = "MEGATRON_PAGING_BENCH_MEMORY_FRACTION"


@dataclass(frozen=True)
class BenchControls:
    """The benchmark controls of one run (defaults: what a user runs)."""

    mcore_manager: bool = False
    kernel_backend: str = "auto"
    overlap: bool = True
    memory_fraction: float | None = None


def bench_controls(environ=None) -> BenchControls:
    """The controls from the environment; ``ValueError`` naming the variable for a bad value."""
    from megatron_paging.config import KERNEL_BACKENDS

    environ = os.environ if environ is None else environ
    implementation = environ.get(IMPLEMENTATION_ENV, "ours")
    if implementation not in ("ours", "mcore"):
        raise ValueError(f"{IMPLEMENTATION_ENV} must be ours or mcore, got {implementation!r}")
    backend = environ.get(KERNEL_BACKEND_ENV, "auto")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(
            f"{KERNEL_BACKEND_ENV} must be one of {', '.join(KERNEL_BACKENDS)}, got {backend!r}"
        )
    no_overlap = environ.get(NO_OVERLAP_ENV, "0")
    if no_overlap not in ("0", "1"):
        raise ValueError(f"{NO_OVERLAP_ENV} must be 0 or 1, got {no_overlap!r}")
    fraction = environ.get(MEMORY_FRACTION_ENV)
    if fraction is not None:
        try:
            fraction = float(fraction)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise ValueError(
                f"{MEMORY_FRACTION_ENV} must be a number in (0, 1], got "
                f"{environ[MEMORY_FRACTION_ENV]!r}"
            )
    controls = BenchControls(implementation == "mcore", backend, no_overlap == "0", fraction)
    if controls.mcore_manager and (backend != "auto" or not controls.overlap):
        raise ValueError(
            f"{KERNEL_BACKEND_ENV} and {NO_OVERLAP_ENV} control our engine; they have no effect "
            f"with {IMPLEMENTATION_ENV}=mcore"
        )
    return controls


def parse_args():
    """Megatron's own parser with the paging flags (no validation, no argument dump)."""
    from megatron.training.arguments import parse_args as megatron_parse_args

    from megatron_paging.mcore.flags import add_paging_args

    return megatron_parse_args(extra_args_provider=add_paging_args)


# Megatron flags that shape a model this example's provider does not build (it builds the local
# decoder block with megatron-paging's experts and attention, nothing else): refused by name
# rather than silently ignored.
IGNORED_MODEL_FLAGS = {
    "mtp_num_layers": "multi-token-prediction layers",
    "spec": "a custom layer spec",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "experimental_attention_variant": "experimental attention variants",
    "use_kitchen": "Kitchen modules",
}


def check_model_flags(args) -> None:
    """Refuse layout flags the example's model provider would ignore."""
    for dest, what in IGNORED_MODEL_FLAGS.items():
        value = getattr(args, dest, None)
        if value:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}: this example builds no {what}; drop the flag")
    if getattr(args, "context_parallel_size", 1) != 1:
        raise ValueError(
            "--context-parallel-size: the example's SDPA core attention has no context "
            "parallelism; use 1"
        )
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError(
            f"--transformer-impl {args.transformer_impl}: this example builds the local "
            "(Transformer-Engine-free) spec; pass --transformer-impl local"
        )


def check(args=None, environ=None):
    """``(args, PagingConfig, BenchControls)`` of this run; exit 2 with one line if refused."""
    import torch

    from megatron_paging.mcore.flags import paging_config

    environ = os.environ if environ is None else environ
    args = parse_args() if args is None else args  # --help prints and exits here
    try:
        controls = bench_controls(environ)
        config = paging_config(args, environ, mcore_manager=controls.mcore_manager)
        config = config.replace(kernel_backend=controls.kernel_backend, overlap=controls.overlap)
        if args.tensor_model_parallel_size != 1:
            raise ValueError(
                "--tensor-model-parallel-size: this example reads batches without TP broadcast; "
                "use 1 (EP and PP work)"
            )
        if args.num_experts is None:
            raise ValueError("--num-experts: this example trains an MoE model; pass it")
        check_model_flags(args)
        if args.fake_process_group and "WORLD_SIZE" not in environ:
            raise ValueError(
                "--fake-process-group emulates one rank of a larger job: set WORLD_SIZE (and "
                "RANK) to the layout's (docs/scale.md)"
            )
        local = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("NPROC") or 1)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError(
                "no CUDA GPU is visible: Megatron's pretrain() needs one per process "
                "(`make test` runs the CPU tests)"
            )
        if gpus < local:
            raise ValueError(f"{local} processes per node but {gpus} GPU(s) visible (NPROC)")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args, config, controls


if __name__ == "__main__":
    import logging
    import warnings

    # Megatron's import-time warnings (no Transformer Engine, no apex) say nothing about the
    # flags; the example's own run prints them.
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    check()
