"""Thin wrapper over the page-tile CUDA kernels (``torch.ops.megatron_paging.stash/reload``).

Argument checks are the reference's (:func:`reference.check_args`) plus what the kernels need:
CUDA tensors and a positive ``max_ctas``. The extension is built and loaded on first use.

Each pool carries a one-int32 completion counter (``pool.kernel_done_counter``) that the
kernels' last CTA uses to commit freelist counters and flags; it is 0 between launches. All
stashes and reloads of one pool must be ordered on one stream (the freelists need that anyway).

Hot path: the operator overloads are resolved once; the record's segment tuples go to the
operator as they are (an ``int[]`` argument takes a tuple), and the pool's tensors are the
pool's own cached views. Per call the wrapper makes at most the byte view of ``src``/``dst``
(none when it already is ``[capacity_rows, row_bytes]`` uint8).
"""

from __future__ import annotations

import functools

import torch

from megatron_paging.kernels import reference
from megatron_paging.pool import PagePool
from megatron_paging.record import PageRecord


@functools.cache
def _ops():
    """The ``(stash, reload)`` operator overloads, built and loaded on first use."""
    try:
        ops = torch.ops.megatron_paging
        return ops.stash.default, ops.reload.default
    except (AttributeError, RuntimeError):
        from megatron_paging.kernels import build

        build.load()
        ops = torch.ops.megatron_paging
        return ops.stash.default, ops.reload.default


def _check(t: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int, what: str):
    if pool.device.type != "cuda":
        raise ValueError(f"the CUDA paging kernels need a CUDA pool, got one on {pool.device}")
    if isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas <= 0:
        raise ValueError(f"max_ctas must be a positive integer, got {max_ctas!r}")
    return reference.check_args(t, record, pool, what)


def _call(op, rows: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int) -> None:
    # ``rows`` is a dtype view (never requires grad): the copy is bytes moving under autograd's
    # feet, never part of a graph.
    op(
        rows,
        pool.cuda_pages,
        pool.host_pages,
        record.live_rows,
        pool.free_list_cuda,
        pool.free_list_host,
        pool.free_list_head,
        pool.free_list_tail,
        pool.free_list_capacity,
        record.page_record,
        record.spilled_to_host,
        pool.flags.values,
        pool.kernel_done_counter,
        record.segment_starts,
        record.segment_rows,
        record.slot_offsets,
        record.page_size,
        record.row_bytes,
        max_ctas,
    )


def stash(src: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int) -> None:
    """Copy the live rows of ``src`` into pages of ``pool`` and fill ``record`` (one launch)."""
    src_rows = _check(src, record, pool, max_ctas, "stash source")
    _call(_ops()[0], src_rows, record, pool, max_ctas)


def reload(dst: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int) -> None:
    """Copy a stashed record's live rows back into ``dst`` and recycle its pages (one launch)."""
    dst_rows = _check(dst, record, pool, max_ctas, "reload destination")
    _call(_ops()[1], dst_rows, record, pool, max_ctas)
