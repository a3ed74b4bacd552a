"""PagingEngine: the one step life cycle of a paging run, model-agnostic.

Every driver — Megatron-Core's adapter (:mod:`megatron_paging.mcore.api`), the demo, the
benchmarks — runs each forward-backward between ``begin_step`` and ``end_step``; the saved-tensor
hook (:class:`megatron_paging.runtime.context.PagingContext`) gets the step's
:class:`~megatron_paging.runtime.scheduler.PagingScheduler` from :meth:`PagingEngine.scheduler_for`.

=============  ==================================================================================
mode           what a step does
=============  ==================================================================================
``calibrate``  the first paging step: no pool exists; records are parked as compact copies of
               their live rows (:class:`~megatron_paging.runtime.calibration.Calibrator`, host reads
               allowed) and the peak in flight is measured. ``end_step`` sizes the pools
               (and makes the kernels' pool handles), so the next step allocates nothing.
``paged``      later steps: ``begin_step`` resets rings and flags in place (no allocation),
               records go through the pools. With ``pool_residency='step'`` the device
               tiers' pages are freed at ``end_step`` and allocated again at ``begin_step``
               (eager runs only: the optimizer step between two steps gets their memory).
``off``        ``begin_step(paging=False)`` (an unpaged rerun, an evaluation): nothing is paged.
=============  ==================================================================================

CUDA graphs: ``begin_step`` and ``end_step`` of a ``paged`` step are sync-free and allocate
nothing, so a capture may sit between them and include them (the reset is then part of the
graph, and ``end_step`` joins the paging stream back into the capture stream). What cannot be
captured is refused with :class:`CaptureError`: a calibration step, or a capture that begins
while the previous step is still open.

Offloaded records (the offloading backend's, :mod:`megatron_paging.pages.offload`) join the same
step and scheduler: the calibration step parks them too and sizes the host-only offload pools and
the arena beside the stash pools; ``begin_step`` resets both; :attr:`PagingEngine.flags` reports the
union of both pools' overflow.
"""

from __future__ import annotations

import logging

import torch

from megatron_paging import kernels
from megatron_paging.config import ConfigError, PagingConfig
from megatron_paging.overflow import demand
from megatron_paging.overflow.demand import DemandGroup, OverflowReport
from megatron_paging.pages.offload import OffloadPools
from megatron_paging.pages.pool import PagePools, PagingFlags
from megatron_paging.runtime.calibration import Calibrator, OffloadCalibrator
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.runtime.streams import CpuStreamBackend, CudaStreamBackend

logger = logging.getLogger(__name__)

# The flags that size each kind of pool's tier, named in overflow reports.
DEVICE_FACTOR_FLAG = "--moe-paged-stash-buffer-size-factor-cuda"
OFFLOAD_FACTOR_FLAG = "--paging-offload-host-factor"

OFF, CALIBRATE, PAGED = "off", "calibrate", "paged"


class CaptureError(RuntimeError):
    """A CUDA-graph capture reached paging work that cannot be captured."""


def _cuda_capturing() -> bool:
    # Without an initialized CUDA context nothing can be capturing (and asking would init one).
    return torch.cuda.is_available() and torch.cuda.is_initialized() and (
        torch.cuda.is_current_stream_capturing()
    )


class PagingEngine:
    """Calibrate on the first paging step, then page every step through pools.

    Args:
        config: the run's options (trusted: validated where it was built).
        stream_backend: the stream backend for every device (tests, instrumentation); default
            one :class:`~megatron_paging.runtime.streams.CudaStreamBackend` per CUDA device (one
            high-priority paging stream each) and a CPU backend for CPU tensors.
        pools: pools to page through from the first step on (no calibration): tests and
            benchmarks that size pools themselves.
    """

    def __init__(self, config: PagingConfig | None = None, stream_backend=None,
                 pools: PagePools | None = None):
        self.config = PagingConfig() if config is None else config
        self._stream_backend = stream_backend
        self._backends: dict[torch.device, object] = {}
        self.mode = OFF  # of the running step, or of the last one once it ended
        self.step_open = False
        self.calibrator: Calibrator | None = None
        self.offload_calibrator: OffloadCalibrator | None = None
        self.pools: PagePools | None = None
        self.offload_pools: OffloadPools | None = None
        self.scheduler: PagingScheduler | None = None
        self._device: torch.device | None = None  # where the records of the run live
        if pools is not None:
            if pools.page_size != self.config.page_size:
                raise ConfigError(
                    "page_size", f"is {self.config.page_size} but the pools' is {pools.page_size}"
                )
            self._set_pools(pools)
            self._device = pools.device
        self._layouts: dict = {}  # record layouts, validated once per run
        self.steps = 0  # paging steps begun in Python (calibration and graph captures included)
        self.nothing_to_page = False  # a calibration saw no record: a capture runs unpaged
        self.replays = 0  # graph calls that ran a captured paged step (capture calls replay too)
        self.unreloaded_records = 0  # records a finished step never reloaded (should stay 0)
        # The pool groups of the last demand_values() (what its values are), and the pages
        # each pool's sized tier needed by the last overflow read ('grow' sizes from them).
        self._demand_groups: list[DemandGroup] = []
        self._needed: tuple[object, dict[int, int]] | None = None
        self._offload_needed: tuple[object, dict[int, int]] | None = None

    # -- configuration -------------------------------------------------------------------
    def configure(self, config: PagingConfig) -> None:
        """Use ``config`` from the next step on. The page size is fixed once pools exist."""
        if self.pools is not None and config.page_size != self.pools.page_size:
            raise ConfigError(
                "page_size",
                f"changed from {self.pools.page_size} to {config.page_size} after the pools "
                "were sized",
            )
        if config.page_size != self.config.page_size:
            self._layouts.clear()
        self.config = config

    # -- step life cycle -----------------------------------------------------------------
    def begin_step(self, paging: bool = True) -> None:
        """Start a forward-backward: calibrate (first paging step) or reset rings and flags."""
        capturing = self.capturing()
        if self.step_open:
            if capturing:
                raise CaptureError(
                    "paging: a CUDA-graph capture began while the previous step was still open "
                    "(end every forward-backward with end_step(); install() does it for "
                    "Megatron's forward_backward_func)"
                )
            self.end_step()  # drivers that never end a step explicitly
        if paging and self.pools is None and capturing and self.nothing_to_page:
            paging = False  # the eager steps before found nothing to page: capture unpaged
        if paging and self.pools is None and capturing:  # refused before any state changes
            raise CaptureError(
                "paging: a CUDA-graph capture began before the page pools were calibrated; "
                "the first paging step must run eagerly (with --cuda-graph-impl "
                "full_iteration, --cuda-graph-warmup-steps must be >= 1)"
            )
        if paging and capturing and self.config.pool_residency == "step":
            raise CaptureError(
                "paging: pool_residency='step' frees the pages between steps, so a CUDA graph "
                "cannot hold their addresses; capture with pool_residency='persistent' "
                "(what --cuda-graph-impl full_iteration selects)"
            )
        self.mode = OFF
        self.step_open = True
        if not paging:
            return
        if self.pools is None:
            self.calibrator = Calibrator()
            self.offload_calibrator = OffloadCalibrator()
            self.mode = CALIBRATE
        else:
            if not self.pools.device_tiers_resident:
                self.pools.acquire_device_tiers()
                kernels.prepare(self.pools, self.config.kernel_backend)
            # a captured step keeps its stash log: its replays count against it (demand.py)
            self.pools.reset(keep_log=capturing)
            if self.offload_pools is not None:
                self.offload_pools.reset(keep_log=capturing)
            self.mode = PAGED
        self.steps += 1

    def end_step(self) -> int:
        """Join the paging stream; after calibration, size the pools. Returns the records the
        step never reloaded (0 in a complete step; they are also logged and counted).

        The step's scheduler is dropped even when ``finish()`` raises (an exception inside a
        layer left a slot open), so the next step starts clean; a calibration that did not
        finish is discarded and repeated.
        """
        scheduler, self.scheduler = self.scheduler, None
        calibrating = self.step_open and self.mode == CALIBRATE
        calibrator, self.calibrator = self.calibrator, None
        offload_calibrator, self.offload_calibrator = self.offload_calibrator, None
        self.step_open = False
        unreloaded = scheduler.finish() if scheduler is not None else 0
        if unreloaded:
            self.unreloaded_records += unreloaded
            logger.warning(
                "paging: %d record(s) of step %d were never reloaded (their pages stayed in use "
                "for the step); a saved tensor was dropped without its backward running",
                unreloaded,
                self.steps,
            )
        offloaded = calibrating and offload_calibrator.saw_records
        if calibrating and not (calibrator.saw_records or offloaded):
            # A pipeline stage without MoE layers (dense-first layers, embedding or loss
            # alone) saves nothing to page: eager steps calibrate again (cheap without
            # records; a later step with records sizes the pools), a capture runs unpaged.
            if not self.nothing_to_page:
                logger.info("paging: step %d saved no record to page (a stage without MoE "
                            "layers?): a CUDA-graph capture on this rank runs unpaged",
                            self.steps)
            self.nothing_to_page = True
        if calibrating and (calibrator.saw_records or offloaded):
            if offloaded:
                self._set_offload_pools(offload_calibrator.size(
                    self.config.page_size, self.config.offload_host_factor, self._device,
                    dma_prefix=self.config.offload_dma_prefix,
                ))
            # Without stash records the stash pools are empty: a later stash record then
            # fails with the stash's "no page pool for row_bytes=..." error.
            self._set_pools(
                calibrator.size_pools(self.config, self._device)
                if calibrator.saw_records else PagePools(self.config.page_size, self._device)
            )
        if self.pools is not None and self.config.pool_residency == "step":
            # After finish(): the paging stream is joined, no page holds a record any more.
            self.pools.release_device_tiers()
        return unreloaded

    def note_replayed_step(self) -> None:
        """A CUDA graph replayed a captured step (no Python ran). If the step paged (pools exist:
        a capture never calibrates), the replay reset the rings and set the flags, so
        :attr:`flags` are that step's; without pools the graph paged nothing."""
        if self.pools is None:
            self.mode = OFF
            return
        self.mode = PAGED
        self.replays += 1

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph."""
        if self._stream_backend is not None:
            return self._stream_backend.capturing()
        return _cuda_capturing()

    # -- pools -----------------------------------------------------------------------------
    def grow(self, factor: float) -> bool:
        """Replace the pools by larger ones (between steps): each tier that overflowed gets what
        the last overflow report counted it needed (demand.grown_pages); without a count, the
        device tier becomes ``factor`` times larger. Pools that need no more pages are kept
        (same objects, same addresses). False: there are no pools yet."""
        if self.pools is None:
            logger.info("paging: nothing to grow (no pools yet)")
            return False
        needed = _needed_for(self._needed, self.pools)
        if self.pools.needs_growth(factor, needed):
            self._set_pools(self.pools.grown(factor, needed))
        if self.offload_pools is not None:  # either may have overflowed
            needed = _needed_for(self._offload_needed, self.offload_pools.pools)
            if self.offload_pools.needs_growth(factor, needed):
                self._set_offload_pools(self.offload_pools.grown(factor, needed))
        return True

    # -- what the step's stashes needed (demand.py) ------------------------------------------
    def demand_values(self) -> torch.Tensor | None:
        """The step's demand counts of every pool group as one device tensor, for the flag
        reduction to carry (no sync); None when the step did not page through pools."""
        groups = []
        if self.pools is not None and self.mode == PAGED:
            groups.append(DemandGroup(self.pools, DEVICE_FACTOR_FLAG, self.config.cuda_factor,
                                      "device"))
            if self.offload_pools is not None:
                groups.append(DemandGroup(self.offload_pools.pools, OFFLOAD_FACTOR_FLAG,
                                          self.config.offload_host_factor, "host"))
        self._demand_groups = groups
        return demand.pack(groups) if groups else None

    def overflow_reports(self, values: tuple[int, ...], rank: int,
                         step: int) -> list[OverflowReport]:
        """This rank's reports for the host ``values`` of :meth:`demand_values`: one per pool
        group that overflowed here. Notes what each pool needed, for :meth:`grow`."""
        readings = demand.read(values, self._demand_groups)
        self._needed = self._offload_needed = None
        reports = []
        for reading in readings:
            needed = {d.pool.row_bytes: demand.grow_target(d, reading.first_overflow)
                      for d in reading.pools}
            if reading.group.pools is self.pools:
                self._needed = (self.pools, needed)
            else:
                self._offload_needed = (reading.group.pools, needed)
            report = demand.report(reading, rank, step)
            if report is not None:
                reports.append(report)
        return reports

    def release_pools(self) -> None:
        """Drop the pools; the next paging step calibrates again (also after one that found
        nothing to page)."""
        self.end_step()
        self.pools = None
        self.offload_pools = None
        self.nothing_to_page = False

    def _set_pools(self, pools: PagePools) -> None:
        kernels.prepare(pools, self.config.kernel_backend)  # outside any capture
        self.pools = pools

    def _set_offload_pools(self, offload: OffloadPools) -> None:
        kernels.prepare(offload.pools, self.config.kernel_backend)
        self.offload_pools = offload

    @property
    def flags(self) -> PagingFlags | None:
        """The sticky device flags of the running (or last) step, if it paged through pools.

        With offload pools: their ``overflow`` and ``invalid_live`` are or-ed in (device ops,
        no sync); ``host_spill`` stays the stash's (an offloaded record is on the host by
        design, not because the device tier was full).
        """
        if self.pools is None or self.mode != PAGED:
            return None
        if self.offload_pools is None:
            return self.pools.flags
        union = PagingFlags(self.pools.device)
        union.values.copy_(self.pools.flags.values)
        offload = self.offload_pools.flags
        union.overflow.bitwise_or_(offload.overflow)
        union.invalid_live.bitwise_or_(offload.invalid_live)
        return union

    # -- the step's scheduler --------------------------------------------------------------
    def scheduler_for(self, device: torch.device) -> PagingScheduler:
        """The running step's scheduler (made on first use, for ``device``'s stream backend)."""
        scheduler = self.scheduler
        if scheduler is not None:
            return scheduler
        if not self.step_open or self.mode == OFF:
            raise RuntimeError("paging: no paging step is running (call begin_step first)")
        if self._device is None:
            self._device = torch.device(device)
        backend = self._stream_backend
        if backend is None:
            backend = self._backends.get(self._device)
            if backend is None:
                backend = self._backends[self._device] = (
                    CudaStreamBackend(self._device)
                    if self._device.type == "cuda"
                    else CpuStreamBackend()
                )
        paged = self.mode == PAGED
        self.scheduler = PagingScheduler(
            backend,
            pools=self.pools if paged else None,
            parker=None if paged else self.calibrator,
            config=self.config,
            layout_cache=self._layouts,
            offload=self.offload_pools if paged else None,
            offload_parker=None if paged else self.offload_calibrator,
        )
        return self.scheduler


def _needed_for(noted: tuple[object, dict[int, int]] | None, pools) -> dict[int, int] | None:
    """The noted pages per row bytes if they were counted for ``pools`` (else None)."""
    return noted[1] if noted is not None and noted[0] is pools else None


__all__ = ["CALIBRATE", "CaptureError", "OFF", "PAGED", "PagingEngine"]
