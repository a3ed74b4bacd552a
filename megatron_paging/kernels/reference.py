"""Pure-torch stash and reload: the executable specification of the paging kernels.

Semantics (identical, byte for byte, to the CUDA kernels and, for one segment, to Megatron-Core
0.19.2's Triton ``paged_stash_copy_kernel`` / ``paged_stash_pop_kernel``):

stash(src, record, pool)
    1. ``page_record`` and ``spilled_to_host`` are zeroed.
    2. A live count outside ``[0, segment rows]`` sets ``invalid_live`` (bit
       ``INVALID_LIVE_COUNT``) and ``overflow``.
    3. If ``overflow`` was already set: nothing else happens (freelists unchanged).
    4. ``required`` = sum over segments of ceil(live / page_size). If the device ring has
       ``tail - head >= required`` free pages the record goes there; else, if the pool has a host
       tier with room, the *whole* record goes to the host tier (``spilled_to_host = 1``,
       ``host_spill`` flag set); else ``overflow`` is set, ``spilled_to_host = 1``, nothing copied.
    5. Pages are popped from the chosen ring in record order (see ``record.py``); the live rows of
       each page are copied; ``head`` advances by ``required``.
    6. ``record.state`` becomes ``RECORD_STASHED`` if the record took pages (in either tier),
       else ``RECORD_EMPTY``.
    7. If ``overflow`` is now set (by this stash or one before), the pool's
       ``stashes_after_overflow`` counts one more (the overflow report's source).

reload(dst, record, pool)
    1. If ``overflow`` is set: the record's live rows (clamped to its segments) of ``dst`` are
       zeroed and nothing else happens. (Megatron-Core leaves them untouched; its destinations
       are uninitialized memory, and a NaN there trips Megatron's gradient NaN check before the
       overflow policy can discard the step.)
    2. Else, if ``record.state`` is not ``RECORD_STASHED`` (reloaded already, or never stashed):
       ``invalid_live`` gets bit ``INVALID_RELOAD``, the live rows are zeroed as in 1, no page
       goes back to a ring.
    3. Else, from the tier ``spilled_to_host`` names, the live rows are copied back to the same
       rows of ``dst``; rows outside the live prefixes keep their bytes; pages are pushed back at
       ``tail`` in record order; ``tail`` advances by ``required``.
    4. In every case ``record.state`` becomes ``RECORD_RELOADED``.

Every dtype is moved as bytes. Nothing here reads a device value on the host: masked-off writes
go to the pool's scratch row / scratch freelist slot instead of being filtered out. The one
exception is a CUDA pool with a host tier: indexing pinned host memory with device indices
needs the indices on the host, so the reference synchronizes there (the CUDA kernels do not).
"""

from __future__ import annotations

import torch

from megatron_paging.kernels.checks import as_rows, check_args
from megatron_paging.pages.pool import (
    DEVICE_TIER,
    HOST_TIER,
    INVALID_LIVE_COUNT,
    INVALID_RELOAD,
    PagePool,
)
from megatron_paging.pages.record import RECORD_EMPTY, RECORD_RELOADED, RECORD_STASHED, PageRecord


def _byte_rows(t: torch.Tensor, record: PageRecord, pool: PagePool, what: str) -> torch.Tensor:
    check_args(t, record, pool, what)
    return as_rows(t, record.capacity_rows, record.row_bytes, what)


def _plan(record: PageRecord):
    """Per-segment page counts and exclusive prefix (device), plus the invalid-live mask."""
    seg_rows = torch.tensor(record.segment_rows, dtype=torch.int64, device=record.device)
    live = record.live_rows
    invalid = ((live < 0) | (live > seg_rows)).any()
    pages = torch.where(invalid, 0, (live.clamp_min(0) + record.page_size - 1) // record.page_size)
    prefix = torch.cumsum(pages, 0) - pages
    return live, pages, prefix, pages.sum(), invalid


def _slot_index(record: PageRecord):
    """For every static slot: its segment and its index inside the segment (host-static)."""
    seg_of_slot, slot_in_seg = [], []
    for s, rows in enumerate(record.segment_rows):
        n = -(-rows // record.page_size)
        seg_of_slot += [s] * n
        slot_in_seg += list(range(n))
    dev = record.device
    return (
        torch.tensor(seg_of_slot, dtype=torch.int64, device=dev),
        torch.tensor(slot_in_seg, dtype=torch.int64, device=dev),
    )


def _paged_rows(record: PageRecord, live: torch.Tensor):
    """Every segment row of the source: (its row, whether it is live, its row in the tier).

    The tier row reads ``page_record``, so call it after the stash has filled the record.
    """
    rows, seg, idx = [], [], []
    for s, (start, n) in enumerate(zip(record.segment_starts, record.segment_rows, strict=True)):
        rows.append(torch.arange(start, start + n, dtype=torch.int64))
        seg.append(torch.full((n,), s, dtype=torch.int64))
        idx.append(torch.arange(n, dtype=torch.int64))
    dev = record.device
    rows, seg_of_row, idx_in_seg = (torch.cat(t).to(dev) for t in (rows, seg, idx))
    row_live = idx_in_seg < live[seg_of_row].clamp_min(0)
    slot_of_row = torch.tensor(record.slot_offsets, dtype=torch.int64, device=dev)[seg_of_row]
    slot_of_row = slot_of_row + idx_in_seg // record.page_size
    tier_row = record.page_record[slot_of_row] * record.page_size + idx_in_seg % record.page_size
    return rows, row_live, tier_row


def _ring_position(start, prefix, seg_of_slot, slot_in_seg, capacity):
    return (start + prefix[seg_of_slot] + slot_in_seg) % capacity.clamp_min(1)


def _host_index(index: torch.Tensor, pool: PagePool) -> torch.Tensor:
    # Indexing pinned host memory needs host indices: the reference's one synchronizing step.
    return index.cpu() if pool.device.type != "cpu" else index


def stash(src: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int = 0) -> None:
    """Copy the live rows of ``src`` into pages of ``pool`` and fill ``record`` (see module doc).

    ``max_ctas`` is the kernel backends' common signature; a pure-torch copy has no grid.
    """
    src_rows = _byte_rows(src, record, pool, "stash source")
    flags = pool.flags
    record.page_record.zero_()
    record.spilled_to_host.zero_()
    live, pages, prefix, required, invalid = _plan(record)

    was_overflow = flags.overflow[0] != 0
    head, tail, cap = pool.free_list_head, pool.free_list_tail, pool.free_list_capacity
    fits_cuda = (tail[DEVICE_TIER] - head[DEVICE_TIER]) >= required
    fits_host = (tail[HOST_TIER] - head[HOST_TIER]) >= required
    ok = ~was_overflow & ~invalid
    use_cuda = ok & fits_cuda
    use_host = ok & ~fits_cuda & fits_host & pool.has_host_tier
    new_overflow = (~was_overflow & ~use_cuda & ~use_host) | invalid

    seg_of_slot, slot_in_seg = _slot_index(record)
    if seg_of_slot.numel():
        slot_live = slot_in_seg < pages[seg_of_slot]
        ids_cuda = pool._free_list_cuda_storage[
            _ring_position(head[DEVICE_TIER], prefix, seg_of_slot, slot_in_seg, cap[DEVICE_TIER])
        ]
        ids_host = pool._free_list_host_storage[
            _ring_position(head[HOST_TIER], prefix, seg_of_slot, slot_in_seg, cap[HOST_TIER])
        ]
        page_ids = torch.where(use_host, ids_host, ids_cuda)
        record.page_record[: seg_of_slot.numel()] = torch.where(
            slot_live & (use_cuda | use_host), page_ids, 0
        )

        rows, row_live, dst_row = _paged_rows(record, live)
        scratch_cuda = pool.cuda_pages.shape[0]
        scratch_host = pool.host_pages.shape[0]
        dst_cuda = torch.where(row_live & use_cuda, dst_row, scratch_cuda)
        dst_host = torch.where(row_live & use_host, dst_row, scratch_host)
        pool._cuda_storage.index_copy_(0, dst_cuda, src_rows[rows])
        if pool.has_host_tier:
            pool._host_storage.index_copy_(
                0, _host_index(dst_host, pool), src_rows[rows].to(pool._host_storage.device)
            )

    advance = torch.stack([torch.where(use_cuda, required, 0), torch.where(use_host, required, 0)])
    head.add_(advance)
    record.spilled_to_host.add_((use_host | new_overflow).to(torch.int64))
    record.state.copy_(torch.where(use_cuda | use_host, RECORD_STASHED, RECORD_EMPTY))
    flags.overflow.bitwise_or_(new_overflow.to(torch.int64))
    flags.host_spill.bitwise_or_(use_host.to(torch.int64))
    flags.invalid_live.bitwise_or_(invalid.to(torch.int64) * INVALID_LIVE_COUNT)
    pool.stashes_after_overflow.add_((was_overflow | new_overflow).to(torch.int64))


def reload(dst: torch.Tensor, record: PageRecord, pool: PagePool, max_ctas: int = 0) -> None:
    """Copy a stashed record's live rows back into ``dst`` and return its pages to the ring.

    ``max_ctas`` is ignored, as in :func:`stash`.
    """
    dst_rows = _byte_rows(dst, record, pool, "reload destination")
    flags = pool.flags
    live, pages, prefix, required, _ = _plan(record)
    from_host = record.spilled_to_host[0] == 1
    overflowed = flags.overflow[0] != 0
    invalid_reload = ~overflowed & (record.state[0] != RECORD_STASHED)
    zero_fill = overflowed | invalid_reload
    active = ~zero_fill & (~from_host | pool.has_host_tier)
    from_cuda = active & ~from_host
    from_host = active & from_host

    seg_of_slot, slot_in_seg = _slot_index(record)
    if seg_of_slot.numel():
        rows, row_live, src_row = _paged_rows(record, live)
        cuda_idx = torch.where(row_live & from_cuda, src_row, pool.cuda_pages.shape[0])
        data = pool._cuda_storage[cuda_idx]
        if pool.has_host_tier:
            host_idx = torch.where(row_live & from_host, src_row, pool.host_pages.shape[0])
            host_data = pool._host_storage[_host_index(host_idx, pool)].to(pool.device)
            data = torch.where(from_host, host_data, data)
        data = torch.where(zero_fill, 0, data)
        keep = ~(row_live & (active | zero_fill))
        dst_rows[rows] = torch.where(keep[:, None], dst_rows[rows], data)

        slot_live = slot_in_seg < pages[seg_of_slot]
        ids = record.page_record[: seg_of_slot.numel()]
        tail, cap = pool.free_list_tail, pool.free_list_capacity
        for tier, use, storage in (
            (DEVICE_TIER, from_cuda, pool._free_list_cuda_storage),
            (HOST_TIER, from_host, pool._free_list_host_storage),
        ):
            pos = _ring_position(tail[tier], prefix, seg_of_slot, slot_in_seg, cap[tier])
            scratch = storage.shape[0] - 1
            storage.index_copy_(0, torch.where(slot_live & use, pos, scratch), ids)

    pool.free_list_tail.add_(
        torch.stack([torch.where(from_cuda, required, 0), torch.where(from_host, required, 0)])
    )
    record.state.fill_(RECORD_RELOADED)
    flags.invalid_live.bitwise_or_(invalid_reload.to(torch.int64) * INVALID_RELOAD)
