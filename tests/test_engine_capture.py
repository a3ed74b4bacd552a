"""PagingEngine under stream capture, checked on the CPU with a fake capture of the compute
stream: no host read or event query inside a captured step, every wait on a captured event, the
refusals to calibrate or to begin a step under capture, and a captured step's gradients."""

from __future__ import annotations

import contextlib
import math
import traceback
import warnings

import pytest
import torch
from engine_helpers import CPU, ROWS, WIDTH, FakeCapture, all_free, cfg, make_pools, one_record

from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import CALIBRATE, OFF, PAGED, CaptureError, PagingEngine
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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


def test_a_capture_after_calibration_steps_that_saw_nothing_runs_unpaged():
    """A pipeline stage without MoE layers saves nothing to page: its eager steps calibrate
    (and find nothing), and a CUDA-graph capture proceeds unpaged, without pools."""
    backend = FakeCapture()
    engine = PagingEngine(cfg(), stream_backend=backend)
    for _ in range(2):  # eager paging steps whose layers save no marked tensor
        engine.begin_step()
        assert engine.mode == CALIBRATE
        engine.end_step()
    assert engine.pools is None and engine.nothing_to_page and engine.steps == 2
    backend.begin_capture()
    engine.begin_step()  # no CaptureError: the captured step is unpaged
    assert engine.mode == OFF and engine.step_open
    engine.end_step()
    backend.end_capture()
    assert engine.steps == 2 and engine.pools is None and backend.violations == []
    engine.begin_step()  # eager steps keep looking: one with records would size the pools
    assert engine.mode == CALIBRATE
    engine.end_step()


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
