"""The example's start-up checks, before Megatron starts: the interpreter, the launch
variables (``NPROC``, ``WORLD_SIZE``, ``RANK``), the flags (Megatron's parser and
``validate_args``, the paging flags), the benchmark controls, a GPU. A refusal is one
``error: ...`` line on stderr and exit status 2.

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
``MEGATRON_PAGING_BENCH_ONE_PAGING_STREAM`` ``1``: offloaded live rows on the paging stream, not
                                          one stream per offload pool
``MEGATRON_PAGING_BENCH_MEMORY_FRACTION`` a fraction in (0, 1]: the process's memory cap
                                          (``torch.cuda.set_per_process_memory_fraction``)
=====================================  ==========================================================
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass

from feature_checks import check_features  # beside this script (its sys.path[0])

IMPLEMENTATION_ENV = "MEGATRON_PAGING_BENCH_IMPLEMENTATION"
KERNEL_BACKEND_ENV = "MEGATRON_PAGING_BENCH_KERNEL_BACKEND"
NO_OVERLAP_ENV = "MEGATRON_PAGING_BENCH_NO_OVERLAP"
ONE_STREAM_ENV = "MEGATRON_PAGING_BENCH_ONE_PAGING_STREAM"
MEMORY_FRACTION_ENV = "MEGATRON_PAGING_BENCH_MEMORY_FRACTION"


@dataclass(frozen=True)
class BenchControls:
    """The benchmark controls of one run (defaults: what a user runs)."""

    mcore_manager: bool = False
    kernel_backend: str = "auto"
    overlap: bool = True
    memory_fraction: float | None = None
    offload_streams: bool = True


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
    no_overlap, one_stream = (environ.get(name, "0") for name in (NO_OVERLAP_ENV, ONE_STREAM_ENV))
    for name, value in ((NO_OVERLAP_ENV, no_overlap), (ONE_STREAM_ENV, one_stream)):
        if value not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {value!r}")
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
    controls = BenchControls(implementation == "mcore", backend, no_overlap == "0", fraction,
                             one_stream == "0")
    if controls.mcore_manager and (
        backend != "auto" or not controls.overlap or not controls.offload_streams
    ):
        raise ValueError(
            f"{KERNEL_BACKEND_ENV}, {NO_OVERLAP_ENV} and {ONE_STREAM_ENV} control our engine; "
            f"they have no effect with {IMPLEMENTATION_ENV}=mcore"
        )
    return controls


# The example's args_defaults for Megatron's validate_args (pretrain_gpt_moe_paged.py).
EXAMPLE_DEFAULTS = {"tokenizer_type": "NullTokenizer"}
UNRECOGNIZED = "unrecognized arguments: "


def _one_line_error(parser, message: str):
    """argparse's error path without the usage: Megatron's usage is ~700 lines, and the one line
    that matters would be the last of them."""
    if message.startswith(UNRECOGNIZED):
        words = message.removeprefix(UNRECOGNIZED).split()
        flags = [w.split("=", 1)[0] for w in words if w.startswith("--")]
        if flags:
            message = f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(flags)}"
            close = difflib.get_close_matches(flags[0], parser._option_string_actions, n=1)
            if close and close[0].startswith(flags[0]):
                message += f" (flags are not abbreviated: did you mean {close[0]}?)"
            elif close:
                message += f" (did you mean {close[0]}?)"
        else:
            message = f"unexpected argument{'s' if len(words) > 1 else ''} {' '.join(words)}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _provider(parser):
    from megatron_paging.mcore.flags import add_paging_args

    parser = add_paging_args(parser)
    parser.error = functools.partial(_one_line_error, parser)
    return parser


def parse_args():
    """Megatron's own parser with the paging flags (no validation, no argument dump); a bad flag
    is one ``error:`` line and exit status 2."""
    from megatron.training.arguments import parse_args as megatron_parse_args

    return megatron_parse_args(extra_args_provider=_provider)


@dataclass(frozen=True)
class Layout:
    """The job's size as the launch variables give it."""

    world: int  # WORLD_SIZE, else the processes torchrun starts (NPROC)
    world_from: str  # the variable it came from
    rank: int | None  # RANK
    local: int  # processes on this node: LOCAL_WORLD_SIZE (in a torchrun worker), else NPROC


def _env_int(environ, name: str, minimum: int) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {text!r}")
    return value


def launch_layout(environ) -> Layout:
    """The launch variables as integers; read before Megatron's parser, which converts
    WORLD_SIZE and RANK with a bare ``int()``."""
    nproc = _env_int(environ, "NPROC", 1)
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_WORLD_SIZE", 1) or nproc or 1
    if world is None:
        return Layout(nproc or 1, "NPROC", rank, local)
    return Layout(world, "WORLD_SIZE", rank, local)


def check_layout(args, layout: Layout, environ):
    """The job's layout against the flags, then Megatron's own ``validate_args`` and the model's
    ``TransformerConfig`` on a copy, as every rank would run them after torchrun started them.
    Returns ``(validated args, TransformerConfig)``: the line as Megatron runs it."""
    from megatron_paging.mcore.flags import offload_backend
    from megatron_paging.mcore.validation import validate, validate_config

    fake = bool(getattr(args, "fake_process_group", False))
    if (not fake and "WORLD_SIZE" in environ and "LOCAL_WORLD_SIZE" not in environ
            and layout.world != layout.local):
        # torchrun sets every worker's WORLD_SIZE to NPROC: the variable would be ignored
        raise ValueError(
            f"WORLD_SIZE={layout.world} but torchrun starts NPROC={layout.local} process(es): "
            "WORLD_SIZE sets the emulated job of --fake-process-group only (docs/scale.md); "
            "unset it"
        )
    if layout.rank is not None and layout.rank >= layout.world:
        raise ValueError(f"RANK={layout.rank} is not a rank of a {layout.world}-rank job "
                         f"({layout.world_from}={layout.world}): 0 <= RANK < {layout.world}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # Megatron's validate_args checks the dense grid; the expert grid only fails later, inside
    # initialize_model_parallel on every rank.
    grids = {
        "TP x PP x CP": {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
                         "--context-parallel-size": getattr(args, "context_parallel_size", 1)},
        "expert TP x EP x PP": {
            "--expert-tensor-parallel-size": getattr(args, "expert_tensor_parallel_size", None)
            or tp,
            "--expert-model-parallel-size": getattr(args, "expert_model_parallel_size", 1),
            "--pipeline-model-parallel-size": pp},
    }
    for label, sizes in grids.items():
        product = 1
        for size in sizes.values():
            product *= size
        if layout.world % product:
            shown = ", ".join(f"{flag} {size}" for flag, size in sizes.items() if size > 1)
            raise ValueError(f"{layout.world_from}={layout.world} is not divisible by {label} = "
                             f"{product} ({shown})")
    trial = copy.deepcopy(args)
    trial.world_size, trial.rank = layout.world, layout.rank or 0
    validate(trial, EXAMPLE_DEFAULTS)
    return trial, validate_config(trial, offload_backend(trial))


# Megatron rewrites flags after the paging checks read them: validate_args turns
# --recompute-activations into selective recompute and --enable-cuda-graph / --external-cuda-graph
# into --cuda-graph-impl local / transformer_engine; the model's TransformerConfig turns
# --moe-layer-recompute into --recompute-modules moe.
REWRITTEN = ("cuda_graph_impl", "recompute_granularity", "recompute_method", "recompute_modules")


def check_as_megatron_runs_it(raw, validated, transformer_config, environ, mcore_manager):
    """The paging checks again, on the line as Megatron will run it; a refusal names what
    Megatron set."""
    from megatron_paging.mcore.flags import paging_config

    for field in REWRITTEN[1:]:
        if hasattr(transformer_config, field):
            setattr(validated, field, getattr(transformer_config, field))
    try:
        paging_config(validated, environ, mcore_manager=mcore_manager)
    except ValueError as error:
        rewritten = []
        selective = getattr(validated, "recompute_granularity", None) == "selective"
        for field in REWRITTEN:
            value = getattr(validated, field, None)
            if field == "recompute_modules" and not selective:
                continue  # a default Megatron keeps without selective recompute
            if value != getattr(raw, field, None) and value is not None:
                shown = " ".join(value) if isinstance(value, list) else value
                rewritten.append(f"--{field.replace('_', '-')} {shown}")
        if not rewritten:
            raise
        raise ValueError(f"{error} (Megatron sets {', '.join(rewritten)} from this line)") from None


def check(args=None, environ=None):
    """``(args, PagingConfig, BenchControls)`` of this run; exit 2 with one line if refused."""
    environ = os.environ if environ is None else environ
    try:
        layout = launch_layout(environ)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    args = parse_args() if args is None else args  # --help prints and exits here
    import torch

    from megatron_paging.mcore.flags import paging_config

    try:
        controls = bench_controls(environ)
        config = paging_config(args, environ, mcore_manager=controls.mcore_manager)
        config = config.replace(kernel_backend=controls.kernel_backend, overlap=controls.overlap,
                                offload_streams=controls.offload_streams)
        if args.tensor_model_parallel_size != 1:
            raise ValueError(
                "--tensor-model-parallel-size: this example reads batches without TP broadcast; "
                "use 1 (EP and PP work)"
            )
        if args.num_experts is None:
            raise ValueError("--num-experts: this example trains an MoE model; pass it")
        check_features(args)
        if args.fake_process_group and "WORLD_SIZE" not in environ:
            raise ValueError(
                "--fake-process-group emulates one rank of a larger job: set WORLD_SIZE (and "
                "RANK) to the layout's (docs/scale.md)"
            )
        validated, transformer_config = check_layout(args, layout, environ)
        check_as_megatron_runs_it(args, validated, transformer_config, environ,
                                  controls.mcore_manager)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError(
                "no CUDA GPU is visible: Megatron's pretrain() needs one per process "
                "(`make test` runs the CPU tests)"
            )
        if gpus < layout.local:
            raise ValueError(f"{layout.local} processes per node but {gpus} GPU(s) visible "
                             "(NPROC)")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args, config, controls


def check_interpreter() -> None:
    """Exit 2 with one line where this interpreter lacks torch or Megatron-Core (a clone before
    set-up, where ``python3`` is the system's)."""
    missing = [name for name, module in (("torch", "torch"), ("megatron-core", "megatron"))
               if importlib.util.find_spec(module) is None]
    if missing:
        print(f"error: {sys.executable} has no {' or '.join(missing)}: run `make demo` first "
              "(it creates .venv, which this script then uses), or set PYTHON= to an "
              "interpreter that has them", file=sys.stderr, flush=True)
        raise SystemExit(2)


if __name__ == "__main__":
    import logging
    import warnings

    check_interpreter()

    # Megatron's import-time warnings (no Transformer Engine, no apex) say nothing about the
    # flags; the example's own run prints them.
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    check()
