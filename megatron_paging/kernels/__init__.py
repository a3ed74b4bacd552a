"""Public entry points of the paging kernels: ``stash`` and ``reload``.

Backends:

* ``"cuda"`` — the page-tile CUDA C++ kernels (``csrc/``), registered as torch operators
  ``megatron_paging::stash`` / ``megatron_paging::reload`` and built on first use.
* ``"reference"`` — the pure-torch specification in :mod:`.reference` (CPU and CUDA).
* ``"auto"`` (default) — ``cuda`` for CUDA tensors, ``reference`` for CPU tensors.

``MEGATRON_PAGING_MAX_CTAS`` (environment, read once at import, default 2048) bounds the number
of CTAs a copy kernel launches; it never bounds capacity or copied rows.
"""

from __future__ import annotations

import os

import torch

from megatron_paging.kernels import reference
from megatron_paging.pool import PagePool
from megatron_paging.record import PageRecord

BACKENDS = ("auto", "cuda", "reference")


def _read_max_ctas() -> int:
    raw = os.environ.get("MEGATRON_PAGING_MAX_CTAS", "2048")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"MEGATRON_PAGING_MAX_CTAS must be a positive integer (it bounds the copy kernels' "
            f"grid), got {raw!r}"
        )
    return value


MAX_CTAS = _read_max_ctas()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend (``cuda`` or ``reference``) for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"paging kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "cuda" if device.type == "cuda" else "reference"
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"paging kernel backend 'cuda' needs CUDA tensors, got {device}")
    return backend


def stash(
    src: torch.Tensor,
    record: PageRecord,
    pool: PagePool,
    backend: str = "auto",
    max_ctas: int | None = None,
) -> None:
    """Copy the live rows of ``src`` into pages of ``pool``; fill ``record``. No host sync."""
    if resolve_backend(backend, pool.device) == "reference":
        reference.stash(src, record, pool)
        return
    from megatron_paging.kernels import cuda_ops

    cuda_ops.stash(src, record, pool, MAX_CTAS if max_ctas is None else max_ctas)


def reload(
    dst: torch.Tensor,
    record: PageRecord,
    pool: PagePool,
    backend: str = "auto",
    max_ctas: int | None = None,
) -> None:
    """Copy a stashed record's live rows back into ``dst``; recycle its pages. No host sync."""
    if resolve_backend(backend, pool.device) == "reference":
        reference.reload(dst, record, pool)
        return
    from megatron_paging.kernels import cuda_ops

    cuda_ops.reload(dst, record, pool, MAX_CTAS if max_ctas is None else max_ctas)


__all__ = ["BACKENDS", "MAX_CTAS", "reload", "resolve_backend", "stash"]
