"""What tests/test_engine.py, tests/test_engine_capture.py, tests/test_pool_residency.py and
tests/test_scheduler_hold.py share: small pools over the reference kernels, one record through a
running step, and FakeCapture, a CPU stream backend with CUDA's stream-capture rules."""

from __future__ import annotations

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.streams import COMPUTE, PAGING, CpuStreamBackend

ROWS, WIDTH, PAGE = 16, 8, 4
ROW_BYTES = WIDTH * 4
CPU = torch.device("cpu")


def cfg(**fields) -> PagingConfig:
    return PagingConfig(**{"page_size": PAGE, "kernel_backend": "reference", **fields})


def make_pools(rows: int = 4 * ROWS) -> PagePools:
    pools = PagePools(PAGE)
    pools.add(ROW_BYTES, cuda_rows=rows)
    return pools


def one_record(engine, live=7, layer=0, reload=True):
    """One record of slot (0, layer, 0) through the running step; returns (source, reloaded)."""
    scheduler = engine.scheduler_for(CPU)
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, layer, 0)
    handle = scheduler.save(source, torch.tensor(live))
    scheduler.commit()
    if not reload:
        return source, None
    scheduler.backward_slot_start(0, layer, 0)
    return source, scheduler.unpack(handle)


def all_free(pools) -> bool:
    return all(p.free_pages() == (p.num_cuda_pages, p.num_host_pages) for p in pools)


class FakeCapture(CpuStreamBackend):
    """A CPU backend whose compute stream can be "captured", with CUDA's capture rules.

    A stream joins the capture by waiting on an event recorded inside it (the compute stream is
    in from the start); an event recorded on a stream outside the capture is not captured.
    Violations: ``done()`` during capture (raises), a wait on an event not recorded inside the
    capture, a launch on a stream outside it, and a joined stream whose last work the compute
    stream never waited on (unjoined at the end of the capture).
    """

    def __init__(self):
        super().__init__()
        self.begin_capture()
        self.capture = False

    def begin_capture(self):
        self.capture, self.violations = True, []
        self.inside: dict[int, int] = {}  # event id -> the paging-stream work it covers
        self.joined, self.paging_work, self.joined_work = {COMPUTE}, 0, 0
        self.counts = {"record": 0, "wait": 0, "stash": 0, "reload": 0}

    def end_capture(self):
        if PAGING in self.joined and self.joined_work < self.paging_work:
            self.violations.append("the paging stream was never joined back into the capture")
        self.capture = False

    def capturing(self):
        return self.capture

    def done(self, event):
        if self.capture:
            raise AssertionError(f"done() queried event {event.what!r} during capture")
        return True

    def record(self, stream, what=""):
        event = super().record(stream, what)
        if self.capture and stream in self.joined:
            self.inside[event.id] = self.paging_work
            self.counts["record"] += 1
        return event

    def wait(self, stream, event, reason=""):
        super().wait(stream, event, reason)
        if not self.capture:
            return
        self.counts["wait"] += 1
        if event.id not in self.inside:
            self.violations.append(f"{stream} waits ({reason}) on {event.what!r}, not captured")
            return
        self.joined.add(stream)
        if stream == COMPUTE and event.stream == PAGING:
            self.joined_work = max(self.joined_work, self.inside[event.id])

    def launch(self, stream, kind, fn, **info):
        info.pop("pool", None)  # no host snapshot of the rings: this backend reads nothing
        if self.capture:
            if stream not in self.joined:
                self.violations.append(f"{kind} launched on {stream} outside the capture")
            self.paging_work += stream == PAGING
            self.counts[kind] = self.counts.get(kind, 0) + 1
        super().launch(stream, kind, fn, **info)
