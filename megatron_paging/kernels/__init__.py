"""The paging kernels: ``stash`` and ``reload`` over a small registry of backends.

==============  =================================================================  ===========
backend         what moves the bytes                                               devices
==============  =================================================================  ===========
``reference``   pure torch (:mod:`.reference`), the executable specification       cpu, cuda
``cuda``        the CUDA kernels (``csrc/``), bulk or tile path chosen per record  cuda
``tile``        the CUDA kernels, CTA-cooperative vector copies forced             cuda
``bulk``        the CUDA kernels, sm90 bulk-copy pipeline forced                   cuda
``auto``        ``cuda`` for CUDA pools, ``reference`` otherwise                   cpu, cuda
==============  =================================================================  ===========

All backends have the same semantics byte for byte (see :mod:`.reference`). Adding one is a
module with a ``copy(reload, tensor, record, pool, max_ctas)`` function plus one
:class:`KernelBackend` line in :data:`REGISTRY`. A grid bound is checked and defaulted where it
enters: here for direct calls (``stash``, ``reload``), in the config for the runtime's, both by
:func:`megatron_paging.config.kernel_grid_bound`; ``copy`` takes a checked one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_paging.config import kernel_grid_bound
from megatron_paging.kernels import reference
from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord


def _reference_copy(reload, tensor, record, pool, max_ctas):
    (reference.reload if reload else reference.stash)(tensor, record, pool, max_ctas)


def _cuda_copy(path: str):
    def copy(reload, tensor, record, pool, max_ctas):
        from megatron_paging.kernels import cuda_ops  # builds the extension on first use

        cuda_ops.copy(reload, tensor, record, pool, max_ctas, path)

    return copy


def _cuda_prepare(pool: PagePool) -> None:
    from megatron_paging.kernels import cuda_ops

    cuda_ops.pool_handle(pool)


@dataclass(frozen=True)
class KernelBackend:
    name: str
    copy: Callable[[bool, torch.Tensor, PageRecord, PagePool, int], None]
    device_types: tuple[str, ...]
    # Per-pool set-up that must happen outside a CUDA-graph capture (None: nothing to do).
    prepare_pool: Callable[[PagePool], None] | None = None

    def stash(self, src, record, pool, max_ctas: int | None = None) -> None:
        """Copy the live rows of ``src`` into pages of ``pool``; fill ``record``. No host sync."""
        self.copy(False, src, record, pool, kernel_grid_bound(max_ctas))

    def reload(self, dst, record, pool, max_ctas: int | None = None) -> None:
        """Copy a stashed record's live rows back into ``dst``; recycle its pages. No sync."""
        self.copy(True, dst, record, pool, kernel_grid_bound(max_ctas))


REGISTRY: dict[str, KernelBackend] = {
    "reference": KernelBackend("reference", _reference_copy, ("cpu", "cuda")),
    "cuda": KernelBackend("cuda", _cuda_copy("auto"), ("cuda",), _cuda_prepare),
    "tile": KernelBackend("tile", _cuda_copy("tile"), ("cuda",), _cuda_prepare),
    "bulk": KernelBackend("bulk", _cuda_copy("bulk"), ("cuda",), _cuda_prepare),
}


def _resolve(name: str, device_type: str) -> KernelBackend:
    if name == "auto":
        name = "cuda" if device_type == "cuda" else "reference"
    backend = REGISTRY.get(name)
    if backend is None:
        raise ValueError(
            f"paging kernel backend must be one of {('auto', *REGISTRY)}, got {name!r}"
        )
    if device_type not in backend.device_types:
        raise ValueError(
            f"paging kernel backend {name!r} runs on {'/'.join(backend.device_types)} tensors, "
            f"got {device_type}"
        )
    return backend


def resolve_backend(name: str, device: torch.device) -> KernelBackend:
    """The concrete backend for tensors on ``device`` (``auto`` resolved)."""
    return _resolve(name, torch.device(device).type)


def stash(src, record: PageRecord, pool: PagePool, backend: str = "auto",
          max_ctas: int | None = None) -> None:
    """Copy the live rows of ``src`` into pages of ``pool``; fill ``record``. No host sync."""
    resolve_backend(backend, pool.device).stash(src, record, pool, max_ctas)


def reload(dst, record: PageRecord, pool: PagePool, backend: str = "auto",
           max_ctas: int | None = None) -> None:
    """Copy a stashed record's live rows back into ``dst``; recycle its pages. No host sync."""
    resolve_backend(backend, pool.device).reload(dst, record, pool, max_ctas)


def prepare(pools, backend: str = "auto") -> None:
    """Whatever a backend must set up per pool before a CUDA-graph capture (CUDA: handles)."""
    for pool in pools:
        prepare_pool = resolve_backend(backend, pool.device).prepare_pool
        if prepare_pool is not None:
            prepare_pool(pool)


__all__ = ["REGISTRY", "KernelBackend", "prepare", "reload", "resolve_backend",
           "stash"]
