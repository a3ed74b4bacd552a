"""Argument checks every kernel backend runs, and the byte view the pure-torch ones need.

Both run on the host before anything is enqueued and read no device value. They are on the
per-record hot path: attribute reads only, and at most two views in :func:`as_rows`.
"""

from __future__ import annotations

import torch

from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord


def check_args(t: torch.Tensor, record: PageRecord, pool: PagePool, what: str) -> None:
    """Raise if ``t`` cannot be the source / destination of ``record`` in ``pool``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
    device = pool.device
    if t.device != device:
        raise ValueError(f"{what} is on {t.device} but the pool is on {device}")
    if record.live_rows.device != device:
        raise ValueError(f"record.live_rows is on {record.device} but the pool is on {device}")
    layout = record.layout
    if layout.row_bytes != pool.row_bytes:
        raise ValueError(
            f"record row_bytes={layout.row_bytes} does not match the pool's {pool.row_bytes}"
        )
    if layout.page_size != pool.page_size:
        raise ValueError(
            f"record page_size={layout.page_size} does not match the pool's {pool.page_size}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(t.stride())})")
    if t.nbytes != layout.capacity_rows * layout.row_bytes:
        raise ValueError(
            f"{what} holds {t.nbytes} bytes ({tuple(t.shape)} {t.dtype}) but the record needs "
            f"{layout.capacity_rows} rows x {layout.row_bytes} bytes = "
            f"{layout.capacity_rows * layout.row_bytes}"
        )


def as_rows(t: torch.Tensor, rows: int, row_bytes: int, what: str) -> torch.Tensor:
    """View a contiguous tensor of any dtype as ``[rows, row_bytes]`` bytes.

    At most two views for a tensor with a dimension (none for one that already is ``[rows,
    row_bytes]`` uint8; a 0-d tensor takes a reshape more). A dtype view never requires grad.
    """
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(t.stride())})")
    if t.nbytes != rows * row_bytes:
        raise ValueError(
            f"{what} holds {t.nbytes} bytes ({tuple(t.shape)} {t.dtype}) but the record needs "
            f"{rows} rows x {row_bytes} bytes = {rows * row_bytes}"
        )
    shape = t.shape
    if t.dtype is not torch.uint8:
        if not shape:
            t = t.reshape(1)  # a 0-d tensor cannot change dtype
        t = t.view(torch.uint8)
        shape = t.shape
    if len(shape) == 2 and shape[0] == rows:
        return t
    return t.view(rows, row_bytes)


__all__ = ["as_rows", "check_args"]
