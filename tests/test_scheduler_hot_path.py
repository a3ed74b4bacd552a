"""The per-record host path stays lean: deterministic counts of stream look-ups, stream switches,
tensor allocations, views and writes (no timings, and not which ATen ops make them).

Kernels are replaced by recording stubs where a test counts the scheduler's own work: the
reference kernels are a specification and allocate freely; the CUDA kernels allocate nothing.
The stubs are registered kernel backends: the scheduler resolves its backend once
(``scheduler.kernel``) and calls its ``copy(reload, tensor, record, pool, max_ctas)``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from op_counter import OpCounter

from megatron_paging import config, kernels
from megatron_paging.config import PagingConfig
from megatron_paging.kernels import KernelBackend, cuda_ops
from megatron_paging.kernels.checks import check_args
from megatron_paging.overflow import demand
from megatron_paging.pages.pool import PagePools
from megatron_paging.pages.record import PageRecord
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.runtime.streams import CpuStreamBackend, CudaStreamBackend

PAGE, ROWS, HIDDEN, LAYERS, RECORDS = 4, 16, 8, 4, 3
PUBLIC_CALLS = ("open_slot", "save", "commit", "backward_slot_start", "prefetch", "unpack",
                "finish")
# The demand count before each one-segment stash (demand.py): in-place ops on the pool's and
# the record's own tensors, no allocation, no view (the kernel counts stashes after overflow).
DEMAND_STASH_WRITES = ["aten.floor_divide.out", "aten.sub_.Tensor", "aten.maximum.out"]


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

    def copy(reload, tensor, record, pool, max_ctas):
        calls.append("reload" if reload else "stash")

    monkeypatch.setitem(kernels.REGISTRY, "noop", KernelBackend("noop", copy, ("cpu",)))
    monkeypatch.setattr(config, "KERNEL_BACKENDS", (*config.KERNEL_BACKENDS, "noop"))
    return calls


@pytest.fixture
def stub_kernels(monkeypatch):
    """Kernels that only run the shared static checks (the CUDA wrapper's host-side work)."""
    calls = []

    def copy(reload, tensor, record, pool, max_ctas):
        calls.append("reload" if reload else "stash")
        check_args(tensor, record, pool, "reload destination" if reload else "stash source")

    monkeypatch.setitem(kernels.REGISTRY, "stub", KernelBackend("stub", copy, ("cpu",)))
    monkeypatch.setattr(config, "KERNEL_BACKENDS", (*config.KERNEL_BACKENDS, "stub"))
    return calls


def make_pools() -> PagePools:
    pools = PagePools(PAGE)
    pools.add(HIDDEN * 4, cuda_rows=ROWS * RECORDS * LAYERS * 2)
    return pools


def make_scheduler(backend, kernel: str, **config) -> PagingScheduler:
    scheduler = PagingScheduler(backend, make_pools(),
                                config=PagingConfig(kernel_backend=kernel, **config))
    assert scheduler.kernel is kernels.REGISTRY[kernel]  # resolved once, at construction
    return scheduler


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
    scheduler = make_scheduler(backend, "stub", prefetch_distance=2, overlap=overlap)
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
    scheduler = make_scheduler(backend, "stub", prefetch_distance=1, overlap=overlap)
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


@pytest.mark.parametrize("overlap", [True, False])
def test_kernel_backend_resolved_once_per_scheduler(stub_kernels, monkeypatch, overlap):
    resolved = []
    real_resolve = kernels.resolve_backend

    def resolve(name, device):
        resolved.append((name, torch.device(device).type))
        return real_resolve(name, device)

    monkeypatch.setattr(kernels, "resolve_backend", resolve)
    scheduler = make_scheduler(CpuStreamBackend(), "stub", overlap=overlap)
    assert resolved == [("stub", "cpu")]
    handles = forward_all(scheduler, [torch.randn(ROWS, HIDDEN)] * RECORDS, torch.tensor([5]))
    for layer in reversed(range(LAYERS)):
        scheduler.backward_slot_start(0, layer, 0)
        for h in handles[layer]:
            scheduler.unpack(h)
    assert scheduler.finish() == 0 and resolved == [("stub", "cpu")]
    assert len(stub_kernels) == 2 * LAYERS * RECORDS


def test_cuda_backend_switches_stream_once_per_scope(monkeypatch):
    """The scope logic without CUDA: on its own device a scope sets the paging stream and
    restores the stream it found (two stream sets, no torch.cuda.stream object); a launch on
    another stream, or a scope entered from another device, goes through torch.cuda.stream."""
    contexts, sets = [], []

    @contextlib.contextmanager
    def fake_stream(stream):
        contexts.append(stream)
        yield

    device = {"index": 0}
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "set_stream", sets.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["index"])
    backend = CudaStreamBackend.__new__(CudaStreamBackend)  # no CUDA needed for the logic
    backend._scoped, backend.device_index = None, 0
    backend.compute_stream = lambda: "compute"
    paging, other, ran = object(), object(), []
    with backend.scope(paging):
        for i in range(5):
            backend.launch(paging, "stash", lambda i=i: ran.append(i))
        backend.launch(other, "stash", lambda: ran.append("other"))  # not the scoped stream
        with backend.scope(paging):  # re-entering the open scope switches nothing
            backend.launch(paging, "reload", lambda: ran.append("nested"))
    backend.launch(paging, "reload", lambda: ran.append("outside"))
    assert ran == [0, 1, 2, 3, 4, "other", "nested", "outside"]
    assert sets == [paging, "compute"]  # set, then restored
    assert contexts == [other, paging]
    assert backend._scoped is None
    with pytest.raises(KeyError), backend.scope(paging):
        raise KeyError("inside")
    assert sets[-1] == "compute" and backend._scoped is None  # restored after an exception
    device["index"] = 1  # entered from another device: torch.cuda.stream handles the device
    with backend.scope(paging):
        assert backend._scoped is paging
    assert contexts[-1] is paging and len(sets) == 4 and backend._scoped is None


def test_save_commit_reload_unpack_allocation_counts(noop_kernels):
    backend = CpuStreamBackend()
    scheduler = make_scheduler(backend, "noop")
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

    # A private save makes nothing: its record's device tensors come with the group's one
    # buffer at commit. A snapshot save: one buffer (live copy + the record's tensors), split
    # once, and one write (the live-count snapshot).
    assert private.allocations == private.views == private.writes == []
    assert (len(snapshot.allocations), len(snapshot.views), len(snapshot.writes)) == (1, 1, 1)
    # Commit: one buffer, split once, for the group's private records; unpack makes no
    # tensors; a reload allocates exactly one destination per record.
    assert (len(commit.allocations), len(commit.views)) == (1, 1)
    assert handle.record.page_record.numel() == handle.record.layout.page_slots
    assert len(reload.allocations) == 2 and reload.views == []
    assert unpack.allocations == [] and unpack.views == []
    assert tensor.shape == tensors[0].shape
    assert noop_kernels.count("stash") == LAYERS * RECORDS + 2


class _Saves(torch.autograd.Function):
    """Saves ``tensors`` for backward (through the installed pack hook) and reads them there."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.unpacked = ctx.saved_tensors  # the unpack hook, on autograd's schedule
        return (grad, *[None] * len(ctx.unpacked))


@pytest.mark.parametrize("overlap", [True, False])
def test_demand_is_counted_on_the_current_stream_before_the_groups_copies(monkeypatch, overlap):
    """Outside the paging stream's scope: there a count would wait for the copies (it reads
    only live counts) and, with one hardware queue, hold every later launch of every stream.
    Counts, peak and stash log still follow queue order: each layer stashes RECORDS records of
    2 pages (5 live rows, 4-row pages)."""
    backend = CountingBackend()
    pools = make_pools()
    pool = pools[HIDDEN * 4]
    scheduler = PagingScheduler(backend, pools,
                                config=PagingConfig(kernel_backend="reference", overlap=overlap))
    counted = []  # (what, open scope, copies launched before it)
    for name in ("note_stash", "note_reload"):
        real = getattr(demand, name)

        def spy(*args, _real=real, _name=name):
            counted.append((_name, backend._open_scope, len(backend.launch_scopes)))
            return _real(*args)

        monkeypatch.setattr(demand, name, spy)
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    handles = []
    for layer in range(LAYERS):
        scheduler.open_slot(0, layer, 0)
        handles.append([scheduler.save(t, torch.tensor([5])) for t in tensors])
        scheduler.commit()
        assert int(pool.pages_in_flight) == 2 * RECORDS * (layer + 1)
    for layer in reversed(range(LAYERS)):
        scheduler.backward_slot_start(0, layer, 0)
        for h, tensor in zip(handles[layer], tensors, strict=True):
            assert torch.equal(scheduler.unpack(h)[:5], tensor[:5])  # the live rows
    assert scheduler.finish() == 0
    assert pool.demand_pages.tolist() == [0, 2 * LAYERS * RECORDS, 0]  # in flight, peak
    assert [src.layer for src in pools.stash_log.sources] == [
        n // RECORDS for n in range(LAYERS * RECORDS)]
    assert [what for what, _, _ in counted] == (
        ["note_stash"] * LAYERS * RECORDS + ["note_reload"] * LAYERS * RECORDS)
    assert {scope for _, scope, _ in counted} == {None}
    # Each group's counts come before its copies: after n groups, n * RECORDS copies.
    assert [launched for _, _, launched in counted] == [
        RECORDS * (n // RECORDS) for n in range(2 * LAYERS * RECORDS)]


def test_the_first_overflow_is_named_by_its_own_stash_not_the_one_before_it():
    """Two records of one group in two pools, the second overflowing: the sticky flag it sets
    is read by its own count, not by the first record's (queued before the second copy)."""
    pools = PagePools(PAGE)
    pools.add(HIDDEN * 4, cuda_rows=ROWS)
    pools.add(HIDDEN * 2, cuda_rows=PAGE)  # one page: a 5-row record needs two
    scheduler = PagingScheduler(CpuStreamBackend(), pools,
                                config=PagingConfig(kernel_backend="reference"))
    scheduler.open_slot(0, 0, 0)
    live = torch.tensor([5])
    handles = [scheduler.save(torch.randn(ROWS, HIDDEN), live),
               scheduler.save(torch.randn(ROWS, HIDDEN).half(), live)]
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)
    for h in handles:
        scheduler.unpack(h)
    scheduler.finish()
    assert pools.flags.read()["overflow"]
    afters = {pool.row_bytes: int(pool.stashes_after_overflow) for pool in pools}
    assert afters == {HIDDEN * 4: 0, HIDDEN * 2: 1}
    first = pools.stash_log.first_overflow(afters, int(pools.stash_log.log_id), {HIDDEN * 2})
    assert first.row_bytes == HIDDEN * 2


def test_mcore_api_steady_state_allocation_counts(noop_kernels):
    """Megatron-Core's call sequence through MCorePagingAPI -> PagingContext -> PagingEngine,
    with autograd invoking the real pack/unpack hooks; counted once the pools exist."""
    pytest.importorskip("megatron.core", reason="the adapter needs megatron-core")
    from megatron_paging.mcore.api import MCorePagingAPI

    engine = PagingEngine(PagingConfig(kernel_backend="noop", page_size=PAGE))
    api = MCorePagingAPI(engine, device=torch.device("cpu"))
    mcore_config = SimpleNamespace(moe_paged_stash_page_size=PAGE,
                                   moe_paged_stash_buffer_size_factor_cuda=2.0,
                                   moe_paged_stash_buffer_size_factor_cpu=0.0)
    tensors = [torch.randn(ROWS, HIDDEN) for _ in range(RECORDS)]
    for t in tensors:
        t.grouped_tensor_scale_inv = False  # Megatron-Core's mark: page this tensor
    live = torch.tensor([5], dtype=torch.int32)  # the dispatcher's count
    counters = None
    phases = ("open", "pack", "commit", "unpack")

    def counting(phase, fn, *args):
        if counters is None:
            return fn(*args)
        with counters[phase]:
            return fn(*args)

    real_pack, real_unpack = api._pack, api.context.unpack
    api._pack = lambda t: counting("pack", real_pack, t)  # the hook get_paged_stash_context
    api.context.unpack = lambda s: counting("unpack", real_unpack, s)  # installs, counted

    def step():
        api.paged_stash_reset(True, mcore_config)
        api.paged_stash_init_chunk_handler(None, None)
        x = torch.zeros(ROWS, HIDDEN, requires_grad=True)
        nodes = []
        for _ in range(LAYERS):
            x = api.paged_stash_group_start(x)
            ctx = counting("open", api.get_paged_stash_context, "expert_fc1", ROWS, live, None)
            with ctx:
                x = _Saves.apply(x, *tensors)
            nodes.append(x.grad_fn)
            x = counting("commit", api.paged_stash_group_commit, x)
        x.sum().backward()
        for node in nodes:
            assert [u.shape for u in node.unpacked] == [t.shape for t in tensors]
        return api.paged_stash_finish()

    assert step() == 0 and engine.mode == "calibrate" and engine.pools is not None
    assert engine.config.cuda_factor == 2.0  # Megatron-Core's config reached the engine
    assert step() == 0 and engine.mode == "paged"  # warm: layouts cached
    counters = {phase: OpCounter() for phase in phases}
    stashes = noop_kernels.count("stash")
    assert step() == 0 and engine.mode == "paged"
    assert noop_kernels.count("stash") - stashes == LAYERS * RECORDS
    assert noop_kernels.count("reload") == 2 * LAYERS * RECORDS
    # Per group: one private int64 copy of the live count (a reshape view at most).
    assert len(counters["open"].allocations) == LAYERS
    assert len(counters["open"].views) <= LAYERS
    assert counters["open"].writes == []
    # The pack hook only takes note; the commit makes one record buffer per group (no
    # live-count snapshot: the group's copy is private), counts the demand and stashes.
    assert counters["pack"].allocations == counters["pack"].views == []
    assert counters["pack"].writes == []
    assert len(counters["commit"].allocations) == LAYERS
    assert counters["commit"].writes == DEMAND_STASH_WRITES * LAYERS * RECORDS
    # One record buffer per group, split once, and the commit's identity view per group.
    assert len(counters["commit"].views) == 2 * LAYERS
    assert counters["unpack"].allocations == [] and counters["unpack"].views == []
    assert counters["unpack"].writes == []
    assert engine.unreloaded_records == 0


# ----------------------------------------------------------------------------- CUDA wrapper


class FakeExtension:
    """Stands in for the extension: records handle constructions and operator calls."""

    def __init__(self):
        self.pools, self.layouts, self.calls = [], [], []
        self.make_pool = lambda *args: (
            self.pools.append(args) or ("pool", len(self.pools)), ""
        )
        self.make_layout = lambda *args: (
            self.layouts.append(args) or ("layout", len(self.layouts)), ""
        )

    def copy(self, **arguments):
        self.calls.append(tuple(arguments.values()))
        return ""


def _same(a, b) -> bool:
    """Tensors are the same argument by identity, anything else by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _passed(call, obj) -> bool:
    return any(_same(arg, obj) for arg in call)


def _differing(first, second) -> list[tuple]:
    """The arguments in which two calls of one operator differ (position-free to the reader)."""
    return [(a, b) for a, b in zip(first, second, strict=True) if not _same(a, b)]


def _tensors(obj) -> list[torch.Tensor]:
    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]


def test_cuda_wrapper_passes_cached_handles_without_new_tensors(monkeypatch):
    """A launch hands the extension what already exists — the pool's and layout's cached
    handles, the user buffer and the record's own device tensors — and makes no tensor, view or
    write on the host path. Checked by identity and value, not by argument position."""
    fake = FakeExtension()
    monkeypatch.setattr(cuda_ops, "library", lambda: fake)
    pool = make_pools()[HIDDEN * 4]
    record = PageRecord.new(ROWS, HIDDEN * 4, PAGE, torch.tensor([5]))
    other = record.layout.new_record(torch.tensor([2]))  # same layout, another record
    rows = torch.zeros(ROWS, HIDDEN * 4, dtype=torch.uint8)
    # The pool handle is made once, outside the hot path, for a CUDA pool (prepare()).
    pool.device = torch.device("cuda", 0)
    handle = cuda_ops.pool_handle(pool)
    pool.device = torch.device("cpu")  # the rest of the call runs its checks on CPU tensors
    assert pool.kernel_handle is handle and cuda_ops.pool_handle(pool) is handle
    (pool_args,) = fake.pools  # made from the pool's own tensors, no copies
    owned = [*_tensors(pool), pool.cuda_pages, pool.flags.values, pool.stashes_after_overflow]
    assert all(any(t is o for o in owned) for t in pool_args if isinstance(t, torch.Tensor))
    for tensor in (pool.cuda_pages, pool.host_pages, pool.flags.values, pool.kernel_done_counter,
                   pool.stashes_after_overflow):
        assert _passed(pool_args, tensor)
    assert _passed(pool_args, PAGE) and _passed(pool_args, HIDDEN * 4)

    with OpCounter() as ops:
        cuda_ops.copy(False, rows, record, pool, 7, "tile")  # first use of the layout: its handle
        cuda_ops.copy(True, rows, record, pool, 7, "tile")
        cuda_ops.copy(False, rows, other, pool, 3, "tile")
    assert ops.views == [] and ops.allocations == [] and ops.writes == []
    assert len(fake.pools) == 1 and len(fake.layouts) == 1  # cached on the pool and layout
    (layout_args,) = fake.layouts
    for value in (ROWS, HIDDEN * 4, PAGE, [0], [ROWS]):
        assert _passed(layout_args, value)
    assert record.layout.kernel_handle == ("layout", 1)
    stash, reload, other_stash = fake.calls
    for call, rec in ((stash, record), (reload, record), (other_stash, other)):
        # live_rows, page_record, spilled_to_host, ...; not the demand count's scratch
        state = [t for t in _tensors(rec) if t is not rec.needed_pages_negated]
        assert state and all(_passed(call, t) for t in state)
        assert _passed(call, rows) and _passed(call, handle)
        assert _passed(call, rec.layout.kernel_handle) and _passed(call, cuda_ops.TILE)
        # every tensor argument existed before the call: the buffer or the record's state
        assert all(any(t is k for k in (rows, *state)) for t in call if isinstance(t, torch.Tensor))
    # One record stashed, then reloaded: only the direction differs.
    assert _differing(stash, reload) == [(False, True)]
    # Another record of the same layout with another grid bound: its state and the bound differ.
    changed = _differing(stash, other_stash)
    assert [pair for pair in changed if not isinstance(pair[0], torch.Tensor)] == [(7, 3)]
    assert {id(b) for a, b in changed if isinstance(b, torch.Tensor)} == {
        id(t) for t in _tensors(other) if t is not other.needed_pages_negated
    }
