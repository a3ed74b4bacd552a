"""PagingEngine: the step life cycle (off / calibrate / paged), pool sizing and replacement, and
capture-awareness, checked on the CPU with a fake capture of the compute stream."""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
import warnings

import pytest
import torch

from megatron_paging.config import ConfigError, PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import CALIBRATE, OFF, PAGED, CaptureError, PagingEngine
from megatron_paging.runtime.streams import COMPUTE, PAGING, CpuStreamBackend
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks

ROWS, WIDTH, PAGE = 16, 8, 4
ROW_BYTES = WIDTH * 4
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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


# -- the life cycle -----------------------------------------------------------------------------


def test_off_calibrate_paged_modes_and_flags():
    backend = CpuStreamBackend()
    engine = PagingEngine(cfg(cuda_factor=1.5), stream_backend=backend)
    assert (engine.mode, engine.flags, engine.pools, engine.step_open) == (OFF, None, None, False)
    engine.begin_step(paging=False)  # an unpaged step: nothing to schedule
    assert engine.mode == OFF and engine.step_open
    with pytest.raises(RuntimeError, match="begin_step"):
        engine.scheduler_for(CPU)
    assert engine.end_step() == 0 and engine.steps == 0 and engine.pools is None

    engine.begin_step()  # the first paging step calibrates
    assert engine.mode == CALIBRATE and engine.calibrator is not None and engine.flags is None
    source, out = one_record(engine, live=7)
    assert torch.equal(out[:7], source[:7]) and not out[7:].any()  # parked, zero padding
    assert engine.scheduler.parker is engine.calibrator and engine.scheduler.pools is None
    assert engine.pools is None  # sized only when the calibration step ends
    assert not backend.entries("launch")  # nothing was stashed through pages
    assert engine.end_step() == 0
    pools = engine.pools
    # Peak: 7 live rows = 2 pages = 8 rows; x 1.5 = 12 rows = 3 pages.
    assert [(p.row_bytes, p.num_cuda_pages, p.num_host_pages) for p in pools] == [(ROW_BYTES, 3, 0)]
    assert engine.calibrator is None and engine.scheduler is None and engine.steps == 1

    engine.begin_step()  # later steps page through the pools
    assert engine.mode == PAGED and engine.pools is pools and engine.flags is pools.flags
    source, out = one_record(engine, live=5)
    assert engine.scheduler.pools is pools and torch.equal(out[:5], source[:5])
    assert [e.kind for e in backend.entries("launch")] == ["stash", "reload"]
    assert engine.end_step() == 0 and all_free(pools)
    assert engine.flags is pools.flags  # the last step's flags, read after it ended

    engine.begin_step(paging=False)  # an unpaged rerun keeps the pools but has no flags
    assert engine.mode == OFF and engine.flags is None and engine.pools is pools
    engine.end_step()
    assert engine.steps == 2


def test_paged_begin_step_resets_rings_and_flags_in_place(caplog):
    pools = make_pools()
    engine = PagingEngine(cfg(), stream_backend=CpuStreamBackend(), pools=pools)
    engine.begin_step()
    assert engine.mode == PAGED  # pools given: no calibration
    one_record(engine, reload=False)  # its pages stay taken
    pools.flags.overflow.fill_(1)
    with caplog.at_level(logging.WARNING, logger="megatron_paging.runtime.engine"):
        assert engine.end_step() == 1
    assert engine.unreloaded_records == 1  # counted, and reported by one warning
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    pool = pools[ROW_BYTES]
    assert pool.free_pages()[0] == pool.num_cuda_pages - 2
    tensors = (pool.cuda_pages, pool.free_list_head, pool.free_list_cuda, pools.flags.values)
    pointers = [t.data_ptr() for t in tensors]
    engine.begin_step()
    assert all_free(pools) and not any(pools.flags.read().values())
    assert [t.data_ptr() for t in tensors] == pointers and engine.pools is pools  # no allocation


def test_calibration_sizes_pools_from_the_hints_the_hook_attached():
    """pack_marked annotations reach the calibrator: key 32 is hinted (positive factor sizes
    from avg_rows), key 64 is not (measured peak)."""
    engine = PagingEngine(cfg(cuda_factor=1.0))
    context = PagingContext(engine)
    a, b = torch.randn(ROWS, WIDTH), torch.randn(ROWS, 2 * WIDTH)
    w_a = torch.randn(ROWS, WIDTH, requires_grad=True)
    w_b = torch.randn(ROWS, 2 * WIDTH, requires_grad=True)

    def pack(t):
        if t is a:
            return context.pack_marked(t, torch.tensor(13), annotations={"avg_rows": 3})
        if t is b:
            return context.pack_marked(t, torch.tensor(13))
        return context.pack(t)

    context.begin_step()
    assert engine.mode == CALIBRATE
    context.open_slot(0, 0, 0, CPU)
    with context.hooks(pack):
        y = (a * w_a).sum() + (b * w_b).sum()
    context.group_commit(y).backward()
    for w, t in ((w_a, a), (w_b, b)):  # the 13 live rows came back, the padding as zeros
        assert torch.equal(w.grad[:13], t[:13]) and not w.grad[13:].any()
    assert context.finish() == 0
    assert engine.pools[ROW_BYTES].num_cuda_pages == 1  # ceil(3 / 4) pages
    assert engine.pools[2 * ROW_BYTES].num_cuda_pages == 4  # ceil(13 / 4) pages


def test_configure_refuses_a_page_size_change_once_pools_exist():
    engine = PagingEngine(cfg())
    engine.configure(cfg(page_size=8))  # no pools yet: fine
    assert engine.config.page_size == 8
    engine.configure(cfg())
    engine.begin_step()
    one_record(engine)
    engine.end_step()
    assert engine.pools.page_size == PAGE
    with pytest.raises(ConfigError, match="page_size") as error:
        engine.configure(cfg(page_size=8))
    assert error.value.field == "page_size" and "\n" not in str(error.value)
    assert engine.config.page_size == PAGE
    engine.configure(cfg(prefetch_distance=3, overlap=False))  # other options: next step on
    engine.begin_step()
    scheduler = engine.scheduler_for(CPU)
    assert (scheduler.prefetch_distance, scheduler.overlap) == (3, False)
    engine.end_step()
    with pytest.raises(ConfigError, match="page_size"):
        PagingEngine(cfg(page_size=8), pools=make_pools())


def test_a_step_that_died_inside_a_layer_does_not_poison_the_next_steps():
    pools = make_pools()
    engine = PagingEngine(cfg(), stream_backend=CpuStreamBackend(), pools=pools)
    engine.begin_step()
    scheduler = engine.scheduler_for(CPU)
    scheduler.open_slot(0, 1, 0)
    scheduler.save(torch.randn(ROWS, WIDTH), torch.tensor(7))
    # The layer raised before its commit: the next step reports the open slot once...
    with pytest.raises(RuntimeError, match=r"\(0, 1, 0\)"):  # names the open slot
        engine.begin_step()
    assert engine.scheduler is None and not engine.step_open
    # ...and then runs normally.
    engine.begin_step()
    assert engine.scheduler_for(CPU) is not scheduler
    source, out = one_record(engine, layer=1)
    assert torch.equal(out[:7], source[:7])
    assert engine.end_step() == 0
    assert engine.scheduler is None and engine.unreloaded_records == 0 and all_free(pools)


def test_a_calibration_that_died_is_discarded_and_repeated():
    engine = PagingEngine(cfg(cuda_factor=1.0))
    engine.begin_step()
    one_record(engine, live=ROWS, reload=False)  # a 4-page record parked ...
    engine.scheduler_for(CPU).open_slot(0, 1, 0)  # ... then the step died inside a layer
    with pytest.raises(RuntimeError, match=r"\(0, 1, 0\)"):
        engine.end_step()
    assert engine.pools is None and engine.calibrator is None
    engine.begin_step()
    assert engine.mode == CALIBRATE
    one_record(engine, live=3)
    engine.end_step()
    assert engine.pools[ROW_BYTES].num_cuda_pages == 1  # this calibration's peak only


def test_grow_release_pools_and_replayed_steps(caplog):
    engine = PagingEngine(cfg())
    with caplog.at_level(logging.INFO, logger="megatron_paging.runtime.engine"):
        engine.grow(2.0)  # no pools yet: nothing to grow, said once
    assert engine.pools is None and engine.offload_pools is None and len(caplog.records) == 1
    engine.note_replayed_step()  # a replayed graph that paged nothing (no pools): no flags
    assert (engine.mode, engine.replays, engine.flags) == (OFF, 0, None)

    pools = make_pools()
    engine = PagingEngine(cfg(), pools=pools)
    engine.grow(2.0)
    grown = engine.pools
    assert grown is not pools and grown[ROW_BYTES].num_cuda_pages == 2 * (4 * ROWS // PAGE)
    engine.begin_step()
    assert engine.flags is grown.flags
    one_record(engine)
    engine.end_step()

    engine.begin_step(paging=False)
    engine.end_step()
    assert engine.flags is None
    engine.note_replayed_step()  # a graph replayed a captured paged step: its flags count
    assert (engine.mode, engine.replays, engine.steps) == (PAGED, 1, 1)
    assert engine.flags is grown.flags

    engine.begin_step()
    one_record(engine, reload=False)
    engine.release_pools()  # ends the open step, drops the pools
    assert engine.pools is None and not engine.step_open and engine.unreloaded_records == 1
    engine.begin_step()
    assert engine.mode == CALIBRATE


# -- capture-awareness --------------------------------------------------------------------------


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


HOST_READS = {
    torch.Tensor: ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__",
                   "__float__", "__index__", "__complex__", "__repr__", "__format__"),
    torch: ("equal", "allclose", "is_nonzero", "nonzero", "masked_select", "unique"),
}


class HostReads(list):
    """Host reads of tensor values (one line each: what, where) made inside ``watch()``."""

    watching = False

    @contextlib.contextmanager
    def watch(self):
        self.watching = True
        try:
            yield
        finally:
            self.watching = False


@pytest.fixture
def host_reads(monkeypatch):
    reads = HostReads()
    for owner, names in HOST_READS.items():
        for name in names:
            original = getattr(owner, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                if reads.watching:
                    where = [f"{f.filename.split('/')[-1]}:{f.lineno}"
                             for f in traceback.extract_stack(limit=6)[:-1]]
                    reads.append(f"{_name} at {' < '.join(reversed(where))}")
                return _original(*args, **kwargs)

            monkeypatch.setattr(owner, name, spy)
    return reads


def test_the_host_read_spy_sees_hooks_and_backward(host_reads):
    x = torch.randn(4, requires_grad=True)

    def pack(t):
        int(t.sum())
        return t

    with host_reads.watch():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = x.sin().sum()
        y.backward()
        bool(x.grad.any())
    assert [r.split()[0] for r in host_reads] == ["__int__", "__bool__"]
    host_reads.clear()
    (x * 2).sum()  # outside watch(): not recorded
    assert host_reads == []


def test_begin_step_refuses_to_calibrate_under_capture(host_reads):
    backend = FakeCapture()
    engine = PagingEngine(cfg(), stream_backend=backend)
    backend.begin_capture()
    with host_reads.watch():
        for _ in range(2):  # a refused begin leaves nothing open: the same refusal again
            with pytest.raises(CaptureError, match="--cuda-graph-warmup-steps") as e:
                engine.begin_step()  # names the flag that gives calibration its eager step
            assert "\n" not in str(e.value)
            assert not engine.step_open and engine.steps == 0 and engine.pools is None
    backend.end_capture()
    assert backend.violations == [] and host_reads == []
    engine.begin_step()  # eagerly, calibration runs
    assert engine.mode == CALIBRATE


def test_a_capture_after_calibration_steps_that_saw_nothing_says_so():
    backend = FakeCapture()
    engine = PagingEngine(cfg(), stream_backend=backend)
    for _ in range(2):  # eager paging steps whose layers save no marked tensor
        engine.begin_step()
        engine.end_step()
    assert engine.pools is None and engine.steps == 2
    backend.begin_capture()
    with pytest.raises(CaptureError, match=r"\b2\b") as error:  # counts the eager steps ...
        engine.begin_step()
    backend.end_capture()
    assert "--cuda-graph-warmup-steps" not in str(error.value)  # ... which did run eagerly
    assert not engine.step_open and engine.pools is None


def test_begin_step_refuses_a_capture_while_the_previous_step_is_open(host_reads):
    backend = FakeCapture()
    pools = make_pools()
    engine = PagingEngine(cfg(), stream_backend=backend, pools=pools)
    engine.begin_step()
    one_record(engine)  # eager paged work: events recorded before the capture
    backend.begin_capture()
    with host_reads.watch(), pytest.raises(CaptureError, match="end_step") as error:
        engine.begin_step()
    backend.end_capture()
    assert "\n" not in str(error.value)
    assert backend.violations == [] and host_reads == []
    assert backend.counts == {"record": 0, "wait": 0, "stash": 0, "reload": 0}
    assert engine.step_open and engine.mode == PAGED  # the open step is left as it was
    assert engine.end_step() == 0 and all_free(pools)


def dualpipev_ops():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_paging.mcore import op_order
    return op_order.dualpipev(pp=2, rank=1, microbatches=5)  # overlapped F+B pairs, W ops


def test_a_captured_paged_step_reads_nothing_and_waits_only_on_captured_events(host_reads):
    """Calibrate, an eager paged step, then a whole paged step under capture: no host read or
    event query, every wait on a captured event, paging joined back; the control's grads."""
    ops, shape = dualpipev_ops(), (32, 16)
    control = synthetic_chunks(2, 3, seed=3)
    run_schedule(control, ops, PagingContext(None), shape, seed=3)
    chunks = synthetic_chunks(2, 3, seed=3)
    backend = FakeCapture()
    engine = PagingEngine(cfg(), stream_backend=backend)
    context = PagingContext(engine)
    for _ in range(2):  # calibration, then an eager paged step (events outside the capture)
        assert run_schedule(chunks, ops, context, shape, seed=3) == 0
        for p in (p for layers in chunks for layer in layers for p in layer.parameters()):
            p.grad = None
    assert engine.mode == PAGED
    start = len(backend.log)
    backend.begin_capture()
    with host_reads.watch():
        left = run_schedule(chunks, ops, context, shape, seed=3)
    backend.end_capture()
    assert backend.violations == [] and host_reads == []
    assert left == 0 and not engine.step_open and engine.steps == 3
    counts = backend.counts
    assert counts["stash"] > 0 and counts["reload"] == counts["stash"] and counts["wait"] > 0
    assert any(e.kind == "reload" and e.info["branch"] == "wgrad" for e in backend.log[start:])
    assert all_free(engine.pools) and not any(engine.pools.flags.read().values())
    expected, got = parameter_grads(control), parameter_grads(chunks)
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_captured_step_whose_slots_page_nothing_joins_no_stream():
    """A slot that saves no marked tensor never forks the paging stream into the capture, so
    the end of the step must not wait on it (an event recorded outside the capture)."""
    backend = FakeCapture()
    engine = PagingEngine(cfg(), stream_backend=backend, pools=make_pools())
    context = PagingContext(engine)
    backend.begin_capture()
    context.begin_step()
    context.open_slot(0, 0, 0, CPU)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    y = context.group_commit(x * 2)
    y.sum().backward()
    assert context.finish() == 0
    backend.end_capture()
    assert backend.violations == []
    assert math.isclose(float(x.grad.sum()), 2 * x.numel())
