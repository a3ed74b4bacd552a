"""The per-record host path stays lean: deterministic counts of stream look-ups, stream switches,
tensor allocations and views (no timings).

Kernels are replaced by recording stubs where a test counts the scheduler's own work: the
reference kernels are a specification and allocate freely; the CUDA kernels allocate nothing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_paging import kernels
from megatron_paging.kernels import cuda_ops, reference
from megatron_paging.mcore.engine import PagingEngine
from megatron_paging.pool import PagePools
from megatron_paging.record import PageRecord
from megatron_paging.scheduler import PagingScheduler
from megatron_paging.streams import CpuStreamBackend, CudaStreamBackend

PAGE, ROWS, HIDDEN, LAYERS, RECORDS = 4, 16, 8, 4, 3
PUBLIC_CALLS = ("open_slot", "save", "commit", "backward_slot_start", "prefetch", "unpack",
                "finish")


class OpCounter(TorchDispatchMode):
    """Counts aten ops by class: views, allocations (new storage), in-place writes.

    ``t.view(dtype)`` is not differentiable, so autograd emits an ``aten.detach`` under it: that
    detach is part of the one Python-level view and is not counted as another.
    """

    def __init__(self):
        super().__init__()
        self.views, self.allocations, self.writes = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default and self.views[-1:] == ["aten.view.dtype"]:
            pass
        elif func.is_view:
            self.views.append(str(func))
        elif func._schema.is_mutable:
            self.writes.append(str(func))
        else:
            self.allocations.append(str(func))
        return func(*args, **(kwargs or {}))


class CountingBackend(CpuStreamBackend):
    """CPU backend that counts compute-stream look-ups and scopes, and where launches ran."""

    def __init__(self):
        super().__init__()
        self.compute_lookups = 0
        self.scopes: list[str] = []
        self.launch_scopes: list[tuple[str, str | None]] = []  # (launch stream, open scope)
        self._open_scope: str | None = None

    def compute_stream(self):
        self.compute_lookups += 1
        return super().compute_stream()

    @contextlib.contextmanager
    def scope(self, stream):
        self.scopes.append(stream)
        previous, self._open_scope = self._open_scope, stream
        try:
            with super().scope(stream):
                yield
        finally:
            self._open_scope = previous

    def launch(self, stream, kind, fn, **info):
        self.launch_scopes.append((stream, self._open_scope))
        super().launch(stream, kind, fn, **info)


@pytest.fixture
def noop_kernels(monkeypatch):
    """Kernels that do nothing: what remains is the scheduler's own work."""
    calls = []
    monkeypatch.setattr(kernels, "stash", lambda *args: calls.append("stash"))
    monkeypatch.setattr(kernels, "reload", lambda *args: calls.append("reload"))
    return calls


@pytest.fixture
def stub_kernels(monkeypatch):
    """Kernels that only run the shared static checks (the CUDA wrapper's host-side work)."""
    calls = []

    def stash(src, record, pool, backend="auto", max_ctas=None):
        calls.append("stash")
        reference.check_args(src, record, pool, "stash source")

    def reload(dst, record, pool, backend="auto", max_ctas=None):
        calls.append("reload")
        reference.check_args(dst, record, pool, "reload destination")

    monkeypatch.setattr(kernels, "stash", stash)
    monkeypatch.setattr(kernels, "reload", reload)
    return calls


def make_pools() -> PagePools:
    pools = PagePools(PAGE)
    pools.add(HIDDEN * 4, cuda_rows=ROWS * RECORDS * LAYERS * 2)
    return pools


def counted(scheduler, backend, per_call: list[tuple[str, int]]):
    """Wrap the scheduler's public calls to log (name, compute-stream look-ups) per call."""
    for name in PUBLIC_CALLS:
        method = getattr(scheduler, name)

        def wrapper(*args, _method=method, _name=name, **kwargs):
            before = backend.compute_lookups
            result = _method(*args, **kwargs)
            per_call.append((_name, backend.compute_lookups - before))
            return result

        setattr(scheduler, name, wrapper)


def forward_all(scheduler, tensors, live):
    handles = []
    for layer in range(LAYERS):
        scheduler.open_slot(0, layer, 0)
        handles.append([scheduler.save(t, live) for t in tensors])
        scheduler.commit()
    return handles


@pytest.mark.parametrize("overlap", [True, False])
def test_compute_stream_resolved_at_most_once_per_public_call(stub_kernels, overlap):
    backend = CountingBackend()
    scheduler = PagingScheduler(backend, make_pools(), prefetch_distance=2, overlap=overlap)
    per_call: list[tuple[str, int]] = []
    counted(scheduler, backend, per_call)
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    handles = forward_all(scheduler, tensors, torch.tensor([5]))
    scheduler.prefetch(0, 0)
    scheduler.unpack(handles[0][0])  # nobody reloaded layer 0 yet: a demand reload + wait
    for layer in reversed(range(LAYERS)):
        scheduler.backward_slot_start(0, layer, 0)  # reloads up to 1 + prefetch_distance slots
        for h in handles[layer]:
            scheduler.unpack(h)
    assert scheduler.finish() == 0
    assert {name for name, _ in per_call} == set(PUBLIC_CALLS)
    assert max(n for _, n in per_call) == 1, per_call
    # Work was launched, so the look-ups did happen where needed.
    assert all(n == 1 for name, n in per_call if name == "commit")
    assert stub_kernels.count("stash") == stub_kernels.count("reload") == LAYERS * RECORDS


@pytest.mark.parametrize("overlap", [True, False])
def test_stream_entered_once_per_group(stub_kernels, overlap):
    backend = CountingBackend()
    scheduler = PagingScheduler(backend, make_pools(), prefetch_distance=1, overlap=overlap)
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    handles = forward_all(scheduler, tensors, torch.tensor([5]))
    for layer in reversed(range(LAYERS)):
        scheduler.backward_slot_start(0, layer, 0)
        for h in handles[layer]:
            scheduler.unpack(h)
    scheduler.finish()
    # One scope per commit group and one per reload group (each layer reloads once).
    assert len(backend.scopes) == 2 * LAYERS
    assert len(backend.launch_scopes) == 2 * LAYERS * RECORDS
    assert all(stream == scope for stream, scope in backend.launch_scopes)
    expected = backend.paging_stream if overlap else backend.compute_stream()
    assert set(backend.scopes) == {expected}


def test_cuda_backend_switches_stream_once_per_scope(monkeypatch):
    switches = []

    @contextlib.contextmanager
    def fake_stream(stream):
        switches.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    backend = CudaStreamBackend.__new__(CudaStreamBackend)  # no CUDA needed for the logic
    backend._scoped = None
    paging, other, ran = object(), object(), []
    with backend.scope(paging):
        for i in range(5):
            backend.launch(paging, "stash", lambda i=i: ran.append(i))
        backend.launch(other, "stash", lambda: ran.append("other"))  # not the scoped stream
        with backend.scope(paging):  # re-entering the open scope switches nothing
            backend.launch(paging, "reload", lambda: ran.append("nested"))
    backend.launch(paging, "reload", lambda: ran.append("outside"))
    assert ran == [0, 1, 2, 3, 4, "other", "nested", "outside"]
    assert switches == [paging, other, paging]
    assert backend._scoped is None


def test_save_commit_reload_unpack_allocation_counts(noop_kernels):
    backend = CpuStreamBackend()
    scheduler = PagingScheduler(backend, make_pools())
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    live = torch.tensor([5])
    forward_all(scheduler, tensors, live)  # warm: layouts cached
    scheduler.finish()

    scheduler.open_slot(0, 0, 1)
    with OpCounter() as private:
        handle = scheduler.save(tensors[0], live, live_rows_private=True)
    with OpCounter() as snapshot:
        scheduler.save(tensors[1], live)
    with OpCounter() as commit:
        scheduler.commit()
    with OpCounter() as reload:
        scheduler.backward_slot_start(0, 0, 1)
    with OpCounter() as unpack:
        tensor = scheduler.unpack(handle)
    scheduler.finish()

    # A save: one buffer (live copy + page_record + spilled_to_host) and its three slices.
    assert private.allocations == ["aten.empty.memory_format"]
    assert len(private.views) <= 3 and not private.writes
    assert snapshot.allocations == ["aten.empty.memory_format"]
    assert snapshot.writes == ["aten.copy_.default"]  # the live-count snapshot
    # Commit and unpack make no tensors; a reload allocates exactly one destination per record.
    assert commit.allocations == [] and commit.views == []
    assert reload.allocations == ["aten.empty.memory_format"] * 2 and reload.views == []
    assert unpack.allocations == [] and unpack.views == []
    assert tensor.shape == tensors[0].shape


def test_engine_steady_state_allocation_counts(noop_kernels):
    engine = PagingEngine(kernel_backend="reference")
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    live = torch.tensor([5], dtype=torch.int32)

    def step(counters=None):
        engine.begin_step(True, PAGE, 2.0, 0.0)
        groups, saved = [], []
        for layer in range(LAYERS):
            annotations = {"layer": layer, "microbatch": 0, "vp_stage": 0}
            with counters["open"] if counters else contextlib.nullcontext():
                group = engine.open_group(ROWS, live, annotations)
            with counters["pack"] if counters else contextlib.nullcontext():
                saved.append([engine.pack(group, t) for t in tensors])
            engine.commit(group)
            groups.append(group)
        for layer in reversed(range(LAYERS)):
            engine.reload(groups[layer])
            with counters["unpack"] if counters else contextlib.nullcontext():
                out = [engine.unpack(s) for s in saved[layer]]
            assert [o.shape for o in out] == [t.shape for t in tensors]
        engine.end_step()

    step()  # calibration
    step()  # sizes the pools
    assert engine.mode == "paged"
    counters = {"open": OpCounter(), "pack": OpCounter(), "unpack": OpCounter()}
    step(counters)
    # Per group: one private int64 copy of the live count (a reshape view at most).
    assert len(counters["open"].allocations) == LAYERS
    assert len(counters["open"].views) <= LAYERS
    # Per record: one record buffer; no live-count snapshot (the group's copy is private).
    assert counters["pack"].allocations == ["aten.empty.memory_format"] * LAYERS * RECORDS
    assert counters["pack"].writes == []
    assert counters["unpack"].allocations == [] and counters["unpack"].views == []
    assert engine.unreloaded_records == 0


@pytest.mark.parametrize(
    "make, views",
    [
        (lambda: torch.zeros(ROWS, HIDDEN * 4, dtype=torch.uint8), 0),  # already byte rows
        (lambda: torch.zeros(ROWS, HIDDEN), 1),  # one dtype view
        (lambda: torch.zeros(ROWS, 2, HIDDEN // 2, requires_grad=True), 2),  # dtype + rows
    ],
)
def test_kernel_checks_build_at_most_the_byte_view(make, views):
    pools = make_pools()
    pool = pools[HIDDEN * 4]
    record = PageRecord.new(ROWS, HIDDEN * 4, PAGE, torch.tensor([5]))
    tensor = make()
    with OpCounter() as ops:
        rows = reference.check_args(tensor, record, pool, "src")
    assert len(ops.views) == views and ops.allocations == [] and ops.writes == []
    assert rows.shape == (ROWS, HIDDEN * 4) and rows.dtype == torch.uint8
    assert rows.data_ptr() == tensor.data_ptr() and not rows.requires_grad


def test_cuda_wrapper_passes_cached_metadata_without_new_tensors():
    pools = make_pools()
    pool = pools[HIDDEN * 4]
    record = PageRecord.new(ROWS, HIDDEN * 4, PAGE, torch.tensor([5]))
    rows = torch.zeros(ROWS, HIDDEN * 4, dtype=torch.uint8)
    seen = []
    with OpCounter() as ops:
        cuda_ops._call(lambda *args: seen.append(args), rows, record, pool, 7)
    assert ops.views == [] and ops.allocations == [] and ops.writes == []
    (args,) = seen
    assert args[0] is rows and args[1] is pool.cuda_pages and args[11] is pool.flags.values
    # The record's static tuples go to the operator as they are: no per-call list building.
    assert args[13] is record.segment_starts and args[14] is record.segment_rows
    assert args[15] is record.slot_offsets and args[16:] == (PAGE, HIDDEN * 4, 7)
