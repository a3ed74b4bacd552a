"""PagingEngine: Megatron-Core's paging events, driven through the FIFO paging scheduler.

The adapter (:mod:`.api`) reports four events per MoE layer; the engine maps them onto one
:class:`~megatron_paging.scheduler.PagingScheduler` per step:

==============================  ===========================================================
adapter event                   scheduler call
==============================  ===========================================================
``open_group`` (paging context) ``open_slot(chunk=vp_stage, layer, microbatch)``
``pack`` (saved-tensor hook)    ``save(tensor, live_rows)`` — the live count was cloned when
                                the context opened, so the next microbatch cannot change it
``commit`` (group commit fwd)   ``commit()`` — stash on the paging stream, in issue order
``reload`` (group commit bwd)   ``backward_slot_start(chunk, layer, microbatch)`` — reload,
                                prefetch the next ``prefetch_distance`` layers of the chunk
``unpack`` (saved-tensor hook)  ``unpack(handle)`` — the compute stream waits only now
==============================  ===========================================================

Step life cycle (``begin_step``): the first enabled step calibrates (the scheduler parks
compact live prefixes through a :class:`~megatron_paging.calibration.Calibrator`; host reads
are allowed only there); the next enabled step sizes the pools from the calibrated peak; later
steps only reset rings and flags (no allocation). ``pools`` may be replaced between steps (the
runner's ``grow`` policy does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_paging import kernels
from megatron_paging.calibration import Calibrator
from megatron_paging.pool import PagePools
from megatron_paging.scheduler import PagingScheduler
from megatron_paging.streams import CpuStreamBackend, CudaStreamBackend

logger = logging.getLogger(__name__)

# Megatron-Core pages MXFP8 column-wise scale rows at 1/32 of the token rows.
SCALE_INV_BLOCK_SIZE = 32


@dataclass(eq=False)
class PagedGroup:
    """One layer's paging context: its slot and the live count its records share."""

    capacity_rows: int
    live_rows: torch.Tensor  # int64 [1], this group's own copy, shared by its records
    annotations: dict
    slot: tuple[int, int, int] | None = None  # (chunk, layer, microbatch) once opened
    scale_live_rows: torch.Tensor | None = None  # live_rows // 32, made by the first scale record


@dataclass(eq=False)
class SavedHandle:
    """What the pack hook returns: the scheduler's handle plus the original shape."""

    handle: object
    shape: torch.Size


class PagingEngine:
    """Calibrate on the first enabled step, then page every marked tensor through pools.

    Args:
        kernel_backend: ``auto``, ``cuda`` or ``reference`` (see :mod:`megatron_paging.kernels`).
        prefetch_distance: layers of the same chunk and microbatch reloaded ahead of a backward.
        max_ctas: grid bound for the copy kernels (None: ``MEGATRON_PAGING_MAX_CTAS``).
        overlap: False runs stash and reload on the compute stream (the no-overlap control).
    """

    def __init__(
        self,
        kernel_backend: str = "auto",
        prefetch_distance: int = 1,
        max_ctas: int | None = None,
        overlap: bool = True,
    ):
        if kernel_backend not in kernels.BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {kernels.BACKENDS}, got {kernel_backend!r}"
            )
        if isinstance(prefetch_distance, bool) or not isinstance(prefetch_distance, int):
            raise ValueError(f"prefetch_distance must be an int >= 0, got {prefetch_distance!r}")
        if prefetch_distance < 0:
            raise ValueError(f"prefetch_distance must be an int >= 0, got {prefetch_distance!r}")
        if max_ctas is not None and (
            isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas <= 0
        ):
            raise ValueError(f"max_ctas must be a positive integer or None, got {max_ctas!r}")
        self.kernel_backend = kernel_backend
        self.prefetch_distance = prefetch_distance
        self.max_ctas = max_ctas
        self.overlap = overlap
        self.enabled = False
        self.page_size = 64
        self.calibrator: Calibrator | None = None
        self.pools: PagePools | None = None
        self.scheduler: PagingScheduler | None = None
        self._backends: dict[torch.device, object] = {}
        self._layouts: dict = {}  # record layouts, validated once per run (scheduler's cache)
        self._calibration_device: torch.device | None = None
        self.steps = 0
        self.unreloaded_records = 0  # records a finished step never reloaded (should stay 0)

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
        self.end_step()
        self.enabled = bool(enabled)
        if not self.enabled:
            return
        self.steps += 1
        if self.pools is not None and page_size != self.pools.page_size:
            raise ValueError(
                f"moe_paged_stash_page_size changed from {self.pools.page_size} to {page_size} "
                "after the pools were sized"
            )
        self.page_size = page_size
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

    def end_step(self) -> None:
        """Join the paging stream and drop the step's scheduler state.

        The scheduler is dropped even when ``finish()`` raises (an exception inside a layer left
        a slot open), so the next step starts clean instead of failing forever. Records that a
        step never reloaded are counted and logged: their pages were lost for that step.
        """
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is None:
            return
        unreloaded = scheduler.finish()
        if unreloaded:
            self.unreloaded_records += unreloaded
            logger.warning(
                "paging: %d record(s) of step %d were never reloaded (their pages stayed in use "
                "for the step); a saved tensor was dropped without its backward running",
                unreloaded,
                self.steps,
            )

    def release_pools(self) -> None:
        """Drop the pools; the next enabled step recalibrates."""
        self.end_step()
        self.pools = None
        self.calibrator = None

    @property
    def overflow(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools.flags.overflow

    @property
    def host_spill(self) -> torch.Tensor | None:
        return None if self.pools is None else self.pools.flags.host_spill

    # -- events ----------------------------------------------------------------------------
    def open_group(
        self, capacity_rows: int, live_rows: torch.Tensor, annotations: dict
    ) -> PagedGroup:
        # One allocation + copy per group; every record of the group shares it (read-only).
        live = live_rows.reshape(1).to(torch.int64, copy=True)
        group = PagedGroup(capacity_rows, live, dict(annotations))
        if self.enabled:
            group.slot = (
                int(annotations.get("vp_stage") or 0),
                int(annotations["layer"]),
                int(annotations["microbatch"]),
            )
            self._scheduler_for(live.device).open_slot(*group.slot)
        return group

    def pack(self, group: PagedGroup, tensor: torch.Tensor, columnwise_scale: bool = False):
        """Saved-tensor pack hook body: a handle for ``tensor`` (or the tensor when off)."""
        if group.slot is None:
            return tensor
        rows, live = group.capacity_rows, group.live_rows
        if columnwise_scale:
            rows = rows // SCALE_INV_BLOCK_SIZE
            if group.scale_live_rows is None:
                group.scale_live_rows = live // SCALE_INV_BLOCK_SIZE
            live = group.scale_live_rows
        if rows <= 0 or tensor.numel() % rows:
            raise ValueError(
                f"paging: saved tensor {tuple(tensor.shape)} {tensor.dtype} is not "
                f"{rows} capacity rows (max_num_tokens={group.capacity_rows})"
            )
        tensor_rows = tensor.contiguous()
        if tensor_rows.dim() < 2 or tensor_rows.shape[0] != rows:
            tensor_rows = tensor_rows.view(rows, -1)
        # The group's live count is a private copy nobody writes: no per-record snapshot.
        handle = self.scheduler.save(tensor_rows, live, live_rows_private=True)
        handle.record.annotations.update(group.annotations)
        # Only autograd holds the handle: it (and a reloaded tensor) is freed as soon as the
        # node that saved it has run its backward.
        return SavedHandle(handle, tensor.shape)

    def commit(self, group: PagedGroup) -> None:
        """The group's forward is done: stash its records (or park them while calibrating)."""
        if group.slot is not None and self.scheduler is not None:
            self.scheduler.commit()

    def reload(self, group: PagedGroup) -> None:
        """The group's backward starts: reload it and prefetch the next layers of its chunk."""
        if group.slot is not None and self.scheduler is not None:
            self.scheduler.backward_slot_start(*group.slot)

    def unpack(self, saved) -> torch.Tensor:
        """Saved-tensor unpack hook body: the capacity-shaped tensor, waited for late."""
        if not isinstance(saved, SavedHandle):
            return saved
        tensor = self.scheduler.unpack(saved.handle)
        return tensor if tensor.shape == saved.shape else tensor.view(saved.shape)

    # -- internals -------------------------------------------------------------------------
    def _scheduler_for(self, device: torch.device) -> PagingScheduler:
        if self.scheduler is None:
            if device not in self._backends:
                cuda = device.type == "cuda"
                self._backends[device] = CudaStreamBackend(device) if cuda else CpuStreamBackend()
            options = dict(
                prefetch_distance=self.prefetch_distance,
                overlap=self.overlap,
                kernel_backend=self.kernel_backend,
                page_size=self.page_size,
                layout_cache=self._layouts,
            )
            if self.max_ctas is not None:
                options["max_ctas"] = self.max_ctas
            if self.pools is None:
                self._calibration_device = self._calibration_device or device
            self.scheduler = PagingScheduler(
                self._backends[device],
                pools=self.pools,
                parker=self.calibrator if self.pools is None else None,
                **options,
            )
        return self.scheduler


__all__ = ["PagedGroup", "PagingEngine", "SCALE_INV_BLOCK_SIZE", "SavedHandle"]
