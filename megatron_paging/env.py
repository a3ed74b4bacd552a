"""What this process runs on: versions, optional extras, CUDA, the extension cache."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import platform
import warnings
from pathlib import Path

from megatron_paging.config import DEFAULT_MAX_CTAS, MAX_CTAS_ENV, ConfigError, max_ctas_from_env
from megatron_paging.version import SUPPORTED_MEGATRON_CORE, __version__


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    """Whether ``module`` imports (used to detect optional Transformer Engine / apex)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


def extension_cache_dir() -> Path:
    """Where the JIT-built CUDA extension is cached (under ``$XDG_CACHE_HOME``, default
    ``~/.cache``), one folder per torch and CUDA version."""
    import torch

    cuda = (torch.version.cuda or "none").replace(".", "")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{cuda}"
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "megatron_paging" / "ext" / tag


def check_megatron_core_version() -> str:
    """Return the installed megatron-core version, or raise if it is not the supported one."""
    found = _dist_version("megatron-core")
    if found is None:
        raise RuntimeError(
            f"megatron-core is not installed; megatron-paging needs megatron-core=="
            f"{SUPPORTED_MEGATRON_CORE}"
        )
    if found != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron-core {found} is installed but megatron-paging supports only "
            f"{SUPPORTED_MEGATRON_CORE} (its hook points and patches are version-specific)"
        )
    return found


def info() -> dict[str, object]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "megatron-paging": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": _dist_version("megatron-core") or "not installed",
        "megatron-core supported": SUPPORTED_MEGATRON_CORE,
        "triton": _dist_version("triton") or "not installed",
        "cuda available": cuda,
        "cuda device": torch.cuda.get_device_name() if cuda else "-",
        "torch cuda build": torch.version.cuda or "cpu-only",
        "transformer engine importable": importable("transformer_engine"),
        "apex importable": importable("apex"),
        "extension cache": str(extension_cache_dir()),
        MAX_CTAS_ENV: _max_ctas_shown(),
    }


def _max_ctas_shown() -> str:
    try:
        value = max_ctas_from_env()
    except ConfigError as error:
        return f"invalid: {os.environ.get(MAX_CTAS_ENV)!r} ({error.problem})"
    return f"{DEFAULT_MAX_CTAS} (default)" if value is None else str(value)


CUDA_NOTICE_LOGGER = "torch.utils.cpp_extension"
CUDA_NOTICE = "No CUDA runtime is found"


def _not_the_cuda_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(CUDA_NOTICE)


@contextlib.contextmanager
def without_cuda_runtime_notice():
    """Importing ``torch.utils.cpp_extension`` (Megatron-Core does, at import) logs "No CUDA
    runtime is found" on a machine without a GPU, though nothing is compiled: that one record
    is dropped; every other record of that logger, and every other logger, is untouched."""
    logger = logging.getLogger(CUDA_NOTICE_LOGGER)
    logger.addFilter(_not_the_cuda_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_cuda_notice)


@contextlib.contextmanager
def quiet_megatron_import():
    """Around an import of Megatron-Core where no model is built (the plan, start-up checks): its
    Transformer-Engine/apex-missing warnings and torch's CUDA notice say nothing there."""
    with warnings.catch_warnings(), without_cuda_runtime_notice():
        warnings.simplefilter("ignore")
        yield


def git_commit() -> str:
    """The commit a benchmark measured: ``$GIT_COMMIT`` (set where the tree travels without
    .git, as on the lent GPU machine), else ``git rev-parse HEAD``, else ``"unknown"``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
