"""EagerPaging: the paging engine behind the Megatron-Core adapter (:mod:`.api`).

It turns the adapter's three events into pool operations:

* ``pack(group, tensor)`` (saved-tensor hook, inside a layer's paging context): make a
  :class:`~megatron_paging.record.PageRecord` for the capacity-sized tensor with the group's own
  live-count tensor (cloned when the context opened, so the next microbatch cannot change it);
* ``commit(group)`` (the layer's forward is done): stash the group's records, in issue order, on
  the one paging stream after it waits for the compute stream;
* ``reload(group)`` (the layer's backward is about to start): allocate the destinations on the
  compute stream, reload on the paging stream, record an event per group; ``unpack`` waits on
  that event only when autograd first needs the tensor (waits stay late).

Step life cycle (``begin_step``): the first enabled step calibrates (a
:class:`~megatron_paging.calibration.Calibrator` parks compact live prefixes; host reads allowed
only here); the next enabled step sizes the pools from the calibrated peak and pages. Every
later step only resets the rings and flags (no allocation).

Source lifetimes: after a stash is enqueued the source is handed to the caching allocator with
``record_stream(paging_stream)``, so its memory is reused only after the stash has finished,
without a host sync and without blocking the next layer.

This is the eager engine of the integration; the FIFO multi-source scheduler
(:mod:`megatron_paging.scheduler`) can replace it behind the same four methods.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from megatron_paging import kernels
from megatron_paging.calibration import Calibrator, ParkedRecord
from megatron_paging.pool import PagePools
from megatron_paging.record import PageRecord

# Megatron-Core pages MXFP8 column-wise scale rows at 1/32 of the token rows.
SCALE_INV_BLOCK_SIZE = 32


@dataclass(eq=False)
class PagedGroup:
    """The records one layer's forward saved, with the live count they share."""

    capacity_rows: int
    live_rows: torch.Tensor  # int64 [1], this group's own copy
    annotations: dict
    handles: list = field(default_factory=list)
    reload_event: object = None
    reloaded: bool = False


@dataclass(eq=False)
class PagedHandle:
    """What the pack hook returns for one saved tensor."""

    group: PagedGroup
    record: PageRecord
    shape: torch.Size
    dtype: torch.dtype
    source: torch.Tensor | None  # until stashed (or parked)
    parked: ParkedRecord | None = None
    stashed: bool = False
    result: torch.Tensor | None = None  # reloaded tensor


class EagerPaging:
    """Calibrate on the first enabled step, then page every marked tensor through pools.

    Args:
        kernel_backend: ``auto``, ``cuda`` or ``reference`` (see :mod:`megatron_paging.kernels`).
        prefetch_distance: when a group reloads, also reload this many groups that run their
            backward right after it (the earlier layers of the same chunk and microbatch).
        max_ctas: grid bound for the copy kernels (None: ``MEGATRON_PAGING_MAX_CTAS``).
    """

    def __init__(
        self, kernel_backend: str = "auto", prefetch_distance: int = 1, max_ctas: int | None = None
    ):
        if kernel_backend not in kernels.BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {kernels.BACKENDS}, got {kernel_backend!r}"
            )
        if isinstance(prefetch_distance, bool) or not isinstance(prefetch_distance, int):
            raise ValueError(f"prefetch_distance must be an int >= 0, got {prefetch_distance!r}")
        if prefetch_distance < 0:
            raise ValueError(f"prefetch_distance must be an int >= 0, got {prefetch_distance!r}")
        self.kernel_backend = kernel_backend
        self.prefetch_distance = prefetch_distance
        self.max_ctas = max_ctas
        self.enabled = False
        self.page_size = 64
        self.cuda_factor = 1.10
        self.host_factor = 0.0
        self.calibrator: Calibrator | None = None
        self._calibration_device: torch.device | None = None
        self.pools: PagePools | None = None
        self._paging_streams: dict[torch.device, torch.cuda.Stream] = {}
        # Committed groups per (vp_stage, microbatch), in forward order: backward pops from the end.
        self._committed: dict[tuple, list[PagedGroup]] = {}
        self.steps = 0

    # -- step life cycle -------------------------------------------------------------------
    @property
    def mode(self) -> str:
        if not self.enabled:
            return "off"
        return "paged" if self.pools is not None else "calibrate"

    def begin_step(
        self, enabled: bool, page_size: int, cuda_factor: float, host_factor: float
    ) -> None:
        """Start a forward-backward: calibrate, size pools after calibration, or reset rings."""
        self.enabled = bool(enabled)
        self._committed.clear()
        if not self.enabled:
            return
        self.steps += 1
        if self.pools is not None and page_size != self.page_size:
            raise ValueError(
                f"moe_paged_stash_page_size changed from {self.page_size} to {page_size} "
                "after the pools were sized"
            )
        self.page_size, self.cuda_factor, self.host_factor = page_size, cuda_factor, host_factor
        if self.pools is not None:
            self.pools.reset()
        elif self.calibrator is not None and self.calibrator.peak_rows:
            self.pools = self.calibrator.size_pools(
                page_size, abs(cuda_factor), abs(host_factor), self._calibration_device
            )
            self.calibrator = None
        else:
            self.calibrator = Calibrator(paging=True)
            self._calibration_device = None

    def release_pools(self, scale: float | None = None) -> None:
        """Drop the pools; the next enabled step recalibrates (``scale`` multiplies both factors
        for the ``grow`` policy)."""
        self.pools = None
        self.calibrator = None
        if scale is not None:
            self.cuda_factor *= scale
            self.host_factor *= scale

    @property
    def overflow(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools.flags.overflow

    @property
    def host_spill(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools.flags.host_spill

    # -- records ---------------------------------------------------------------------------
    def open_group(
        self, capacity_rows: int, live_rows: torch.Tensor, annotations: dict
    ) -> PagedGroup:
        live = live_rows.detach().reshape(1).to(torch.int64).clone()
        return PagedGroup(capacity_rows, live, dict(annotations))

    def pack(self, group: PagedGroup, tensor: torch.Tensor, columnwise_scale: bool = False):
        """Saved-tensor pack hook body: a handle for ``tensor`` (or the tensor when off)."""
        if not self.enabled:
            return tensor
        rows, live = group.capacity_rows, group.live_rows
        if columnwise_scale:
            rows, live = rows // SCALE_INV_BLOCK_SIZE, live // SCALE_INV_BLOCK_SIZE
        nbytes = tensor.numel() * tensor.element_size()
        if rows <= 0 or nbytes % rows:
            raise ValueError(
                f"paging: saved tensor {tuple(tensor.shape)} {tensor.dtype} is not "
                f"{rows} capacity rows (max_num_tokens={group.capacity_rows})"
            )
        record = PageRecord.new(rows, nbytes // rows, self.page_size, live)
        record.annotations.update(group.annotations)
        handle = PagedHandle(group, record, tensor.shape, tensor.dtype, tensor.contiguous())
        if self.pools is None:  # calibration: park a compact copy now (host read allowed)
            self._calibration_device = self._calibration_device or tensor.device
            handle.parked = self.calibrator.park(handle.source, record)
            handle.source = None
        group.handles.append(handle)
        return handle

    def commit(self, group: PagedGroup) -> None:
        """The group's forward is done: stash its records on the paging stream, in issue order."""
        key = (group.annotations.get("vp_stage"), group.annotations.get("microbatch"))
        self._committed.setdefault(key, []).append(group)
        if self.pools is None:
            return
        stream = self._stream_for(group.live_rows.device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(group.live_rows.device))
        with self._on(stream):
            for handle in group.handles:
                pool = self.pools[handle.record.row_bytes]
                kernels.stash(
                    handle.source, handle.record, pool, self.kernel_backend, self.max_ctas
                )
                if stream is not None:
                    handle.source.record_stream(stream)
                handle.source = None
                handle.stashed = True

    def reload(self, group: PagedGroup) -> None:
        """The group's backward starts: reload it and prefetch the next groups of its chunk."""
        key = (group.annotations.get("vp_stage"), group.annotations.get("microbatch"))
        stack = self._committed.get(key, [])
        if group in stack:
            index = stack.index(group)
            upcoming = [group] + stack[max(0, index - self.prefetch_distance) : index][::-1]
            del stack[index:]
        else:
            upcoming = [group]
        for g in upcoming:
            self._reload_one(g)

    def _reload_one(self, group: PagedGroup) -> None:
        if group.reloaded:
            return
        group.reloaded = True
        if self.pools is None:
            return
        device = group.live_rows.device
        stream = self._stream_for(device)
        for handle in group.handles:  # destinations belong to the compute stream
            handle.result = torch.empty(handle.shape, dtype=handle.dtype, device=device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with self._on(stream):
            for handle in group.handles:
                if handle.stashed:
                    pool = self.pools[handle.record.row_bytes]
                    kernels.reload(
                        handle.result, handle.record, pool, self.kernel_backend, self.max_ctas
                    )
                    if stream is not None:
                        handle.result.record_stream(stream)
            if stream is not None:
                group.reload_event = torch.cuda.Event()
                group.reload_event.record(stream)

    def unpack(self, handle) -> torch.Tensor:
        """Saved-tensor unpack hook body: the capacity-shaped tensor, waited for late."""
        if not isinstance(handle, PagedHandle):
            return handle
        if handle.parked is not None:
            tensor = self.calibrator_unpark(handle)
        elif handle.source is not None:  # never committed (no group commit): still resident
            tensor = handle.source
        else:
            if not handle.group.reloaded:
                self._reload_one(handle.group)
            if handle.group.reload_event is not None:
                torch.cuda.current_stream(handle.result.device).wait_event(
                    handle.group.reload_event
                )
            tensor = handle.result
        handle.result = handle.source = handle.parked = None
        return tensor.view(handle.shape)

    def calibrator_unpark(self, handle: PagedHandle) -> torch.Tensor:
        calibrator = self.calibrator
        if calibrator is None:  # pools were sized mid-flight: unpark without tracking
            calibrator = Calibrator(paging=True)
            handle.parked.tracked = False
        return calibrator.unpark(handle.parked, handle.record)

    # -- streams ---------------------------------------------------------------------------
    def _stream_for(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._paging_streams:
            # High priority: stashes and reloads are on the critical path of memory reuse.
            self._paging_streams[device] = torch.cuda.Stream(device=device, priority=-1)
        return self._paging_streams[device]

    @staticmethod
    def _on(stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()


__all__ = ["EagerPaging", "PagedGroup", "PagedHandle", "SCALE_INV_BLOCK_SIZE"]
