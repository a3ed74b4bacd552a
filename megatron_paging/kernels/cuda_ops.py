"""Thin wrapper over the CUDA paging kernels (``csrc/``): handles, the path rule, one call.

The extension module (built and imported on first use) provides ``copy`` and two handle
classes. A pool's handle (its tensors' device pointers, the host tier's mapped address) and a
record layout's handle (its segment table) are made once and cached on the pool / layout object,
so a launch passes the user buffer, two handles, the record's four tensors and three ints. Make
pool handles before a CUDA-graph capture (:func:`prepare`; the engine does it when it sizes
pools).

Path rule (:func:`choose_path`), per record, from host-static facts only:

* ``bulk`` (sm90 ``cp.async.bulk`` pipeline) when the GPU is sm90 or newer, ``row_bytes`` is a
  multiple of 16, the user buffer is 16-byte aligned, and the record's capacity is at least
  :data:`BULK_MIN_CAPACITY_BYTES` (smaller launches cannot amortize the pipeline's set-up);
* ``tile`` (CTA-cooperative vector copies) otherwise.

Inside a bulk launch, tiles of the pinned host tier and the zero fill of a reload that moves no
pages still move cooperatively (bulk copies are not used on mapped host memory).

Each pool carries a two-int32 completion counter (``pool.kernel_done_counter``): the kernels'
last CTA uses the first to commit freelist counters, the record's state word and flags; the bulk
path's ticket order takes tiles from the second; both are 0 between launches. All stashes and
reloads of one pool must be ordered on one stream (the freelists need that anyway).
"""

from __future__ import annotations

import functools
import sys

import torch

from megatron_paging.kernels.checks import check_args
from megatron_paging.pages.pool import PagePool, PagePools
from megatron_paging.pages.record import PageRecord, RecordLayout

TILE, BULK = 0, 1  # csrc/paging.h CopyPath
PATHS = {"tile": TILE, "bulk": BULK}
# Below this capacity a launch is too short for the bulk pipeline to pay (measured, see
# docs/kernels.md): the tile path takes it.
BULK_MIN_CAPACITY_BYTES = 1 << 20
BULK_ALIGN = 16


@functools.cache
def library():
    """The extension module: the one already imported (e.g. built for an explicit arch), else
    built (if needed) for the current GPU and imported."""
    from megatron_paging.kernels import build

    return sys.modules.get(build.EXTENSION_NAME) or build.load()


@functools.cache
def bulk_supported(device_index: int) -> bool:
    """Whether the bulk path runs on CUDA device ``device_index`` (sm90 or newer)."""
    return bool(library().bulk_supported(device_index))


def pool_handle(pool: PagePool):
    """The pool's kernel handle, made on first use (never during a capture: see prepare())."""
    handle = pool.kernel_handle
    if handle is None:
        if pool.device.type != "cuda":
            raise ValueError(f"the CUDA paging kernels need a CUDA pool, got one on {pool.device}")
        handle, problem = library().make_pool(
            pool.cuda_pages, pool.host_pages, pool.free_list_cuda, pool.free_list_host,
            pool.free_list_head, pool.free_list_tail, pool.free_list_capacity,
            pool.flags.values, pool.stashes_after_overflow, pool.kernel_done_counter,
            pool.page_size, pool.row_bytes,
        )
        if problem:
            raise ValueError(problem)
        pool.kernel_handle = handle
    return handle


def layout_handle(layout: RecordLayout):
    handle = layout.kernel_handle
    if handle is None:
        handle, problem = library().make_layout(
            layout.capacity_rows, layout.row_bytes, layout.page_size,
            list(layout.segment_starts), list(layout.segment_rows), list(layout.slot_offsets),
        )
        if problem:
            raise ValueError(problem)
        layout.kernel_handle = handle
    return handle


def prepare(pools: PagePools) -> None:
    """Make every pool's handle now (outside any capture: it asks CUDA about host memory)."""
    for pool in pools:
        if pool.device.type == "cuda":
            pool_handle(pool)


def choose_path(tensor: torch.Tensor, record: PageRecord, requested: str = "auto") -> int:
    """The copy path for one launch (see the module docstring); ``requested`` forces one."""
    if requested == "tile":
        return TILE
    device_index = tensor.device.index
    if requested != "auto":
        if requested != "bulk":
            raise ValueError(
                f"copy path must be 'auto' or one of {tuple(PATHS)}, got {requested!r}"
            )
        if not bulk_supported(device_index):
            raise ValueError(
                f"the bulk copy path needs an sm90 (Hopper) or newer GPU; cuda:{device_index} "
                "is older (use kernel backend 'tile' or 'cuda')"
            )
        return BULK
    layout = record.layout
    if (
        layout.row_bytes % BULK_ALIGN == 0
        and layout.capacity_rows * layout.row_bytes >= BULK_MIN_CAPACITY_BYTES
        and tensor.data_ptr() % BULK_ALIGN == 0
        and bulk_supported(device_index)
    ):
        return BULK
    return TILE


def copy(reload: bool, tensor, record: PageRecord, pool: PagePool, max_ctas: int,
         path: str = "auto") -> None:
    """One stash (``reload=False``) or reload of ``record`` through ``pool`` (one launch);
    ``max_ctas`` as :func:`megatron_paging.config.kernel_grid_bound` checked it."""
    check_args(tensor, record, pool, "reload destination" if reload else "stash source")
    # The user buffer goes as it is (any dtype): the extension checks its byte size. It returns
    # its problem instead of raising (no C++ exception crosses the extension). Keywords: the
    # binding's argument names are checked at every call, there is no order to keep in step.
    problem = library().copy(
        reload=reload, user=tensor, pool=pool_handle(pool), layout=layout_handle(record.layout),
        live_rows=record.live_rows, page_record=record.page_record,
        spilled_to_host=record.spilled_to_host, record_state=record.state,
        path=choose_path(tensor, record, path), max_ctas=max_ctas,
    )
    if problem:
        raise RuntimeError(problem)


__all__ = ["BULK", "BULK_MIN_CAPACITY_BYTES", "PATHS", "TILE", "bulk_supported", "choose_path",
           "copy", "layout_handle", "library", "pool_handle", "prepare"]
