"""The kernel registry (CPU): ``REGISTRY``, ``resolve_backend`` (``auto`` and refusals that name
the backend and the device), ``prepare``, ``KernelBackend.stash`` / ``reload`` and the module
functions ``stash`` / ``reload`` dispatching through it."""

from __future__ import annotations

import pytest
import torch

from megatron_paging import kernels
from megatron_paging.config import DEFAULT_MAX_CTAS, ConfigError
from megatron_paging.kernels import REGISTRY, KernelBackend, prepare, resolve_backend
from megatron_paging.pages.pool import PagePool, PagePools
from megatron_paging.pages.record import PageRecord

ROW_BYTES, PAGE_SIZE, ROWS = 8, 4, 10
CHOICES = ("auto", "reference", "cuda", "tile", "bulk")


def small_pool(**kwargs) -> PagePool:
    args = dict(row_bytes=ROW_BYTES, page_size=PAGE_SIZE, num_cuda_pages=4, num_host_pages=2)
    return PagePool(**(args | kwargs))


def small_record(live=3) -> PageRecord:
    return PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(live))


def source() -> torch.Tensor:
    return torch.arange(ROWS * ROW_BYTES, dtype=torch.int32).to(torch.uint8).view(ROWS, ROW_BYTES)


class Spy:
    """A backend's copy/prepare functions that only record their calls."""

    def __init__(self):
        self.calls = []

    def copy(self, reload, tensor, record, pool, max_ctas):
        self.calls.append(("copy", reload, tensor, record, pool, max_ctas))

    def prepare(self, pool):
        self.calls.append(("prepare", pool))


@pytest.fixture
def spy(monkeypatch) -> Spy:
    spy = Spy()
    monkeypatch.setitem(REGISTRY, "spy", KernelBackend("spy", spy.copy, ("cpu",), spy.prepare))
    return spy


# ----------------------------------------------------------------------------- the registry


def test_registry_entries():
    assert tuple(REGISTRY) == CHOICES[1:]
    assert all(backend.name == name for name, backend in REGISTRY.items())
    assert REGISTRY["reference"].device_types == ("cpu", "cuda")
    assert REGISTRY["reference"].prepare_pool is None
    for name in ("cuda", "tile", "bulk"):
        assert REGISTRY[name].device_types == ("cuda",)
        assert REGISTRY[name].prepare_pool is not None


@pytest.mark.parametrize(("name", "device", "expected"), [
    ("auto", "cpu", "reference"),
    ("auto", "cuda", "cuda"),
    ("auto", torch.device("cuda", 1), "cuda"),
    ("reference", "cpu", "reference"),
    ("reference", "cuda:0", "reference"),
    ("cuda", "cuda", "cuda"),
    ("tile", "cuda:0", "tile"),
    ("bulk", torch.device("cuda"), "bulk"),
])
def test_resolve_backend(name, device, expected):
    # Only the device type matters: no CUDA device is needed to resolve.
    assert resolve_backend(name, device) is REGISTRY[expected]


@pytest.mark.parametrize("name", ["triton", "CUDA", "", None, "Reference", "auto "])
def test_unknown_backend_is_refused_with_the_choices(name):
    with pytest.raises(ValueError) as excinfo:
        resolve_backend(name, "cpu")
    assert str(excinfo.value) == (
        f"paging kernel backend must be one of {CHOICES}, got {name!r}"
    )


@pytest.mark.parametrize(("name", "device", "message"), [
    ("cuda", "cpu", "paging kernel backend 'cuda' runs on cuda tensors, got cpu"),
    ("tile", "cpu", "paging kernel backend 'tile' runs on cuda tensors, got cpu"),
    ("bulk", "cpu", "paging kernel backend 'bulk' runs on cuda tensors, got cpu"),
    ("bulk", "meta", "paging kernel backend 'bulk' runs on cuda tensors, got meta"),
    ("reference", "meta", "paging kernel backend 'reference' runs on cpu/cuda tensors, got meta"),
    ("auto", "meta", "paging kernel backend 'reference' runs on cpu/cuda tensors, got meta"),
])
def test_backend_on_a_device_it_does_not_run_on_is_refused(name, device, message):
    with pytest.raises(ValueError) as excinfo:
        resolve_backend(name, device)
    assert str(excinfo.value) == message


def test_a_registered_backend_resolves_and_is_refused_elsewhere(spy):
    assert resolve_backend("spy", "cpu") is REGISTRY["spy"]
    with pytest.raises(ValueError, match="backend 'spy' runs on cpu tensors, got cuda"):
        resolve_backend("spy", "cuda")
    with pytest.raises(ValueError, match=r"one of \('auto', 'reference', 'cuda', 'tile', 'bulk', "
                                         r"'spy'\)"):
        resolve_backend("nope", "cpu")


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(("op", "reload"), [(kernels.stash, False), (kernels.reload, True)])
def test_module_functions_dispatch_through_the_registry(spy, op, reload):
    src, record, pool = source(), small_record(), small_pool()
    op(src, record, pool, backend="spy")
    op(src, record, pool, "spy", 7)
    op(src, record, pool, backend="spy", max_ctas=1)
    assert spy.calls == [("copy", reload, src, record, pool, max_ctas)
                         for max_ctas in (DEFAULT_MAX_CTAS, 7, 1)]


@pytest.mark.parametrize("op", [kernels.stash, kernels.reload])
def test_auto_dispatches_on_the_pools_device(monkeypatch, op):
    spy = Spy()
    monkeypatch.setitem(REGISTRY, "reference", KernelBackend("reference", spy.copy, ("cpu",)))
    src, record, pool = source(), small_record(), small_pool()
    op(src, record, pool)
    assert spy.calls == [("copy", op is kernels.reload, src, record, pool, DEFAULT_MAX_CTAS)]


@pytest.mark.parametrize("op", [kernels.stash, kernels.reload])
def test_module_functions_refuse_before_touching_anything(op):
    pool, record = small_pool(), small_record()
    for backend, words in (("triton", "must be one of"), ("cuda", "'cuda' runs on cuda"),
                           ("bulk", "'bulk' runs on cuda")):
        with pytest.raises(ValueError, match=words):
            op(source(), record, pool, backend=backend)
    assert pool.free_pages() == (4, 2) and record.page_record.tolist() == [0, 0, 0]
    assert pool.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}


@pytest.mark.parametrize("op", [kernels.stash, kernels.reload, REGISTRY["reference"].stash,
                                REGISTRY["reference"].reload])
def test_a_bad_grid_bound_is_refused_before_any_copy(op):
    pool, record = small_pool(), small_record()
    for bad in (0, -1, 2.5, True, "64", 2**31):
        with pytest.raises(ConfigError) as excinfo:
            op(source(), record, pool, max_ctas=bad)
        assert excinfo.value.field == "max_ctas"
    assert pool.free_pages() == (4, 2) and record.page_record.tolist() == [0, 0, 0]


def test_backend_methods_pass_the_direction_and_the_default_grid(spy):
    backend = REGISTRY["spy"]
    src, record, pool = source(), small_record(), small_pool()
    backend.stash(src, record, pool)
    backend.reload(src, record, pool, 3)
    assert spy.calls == [("copy", False, src, record, pool, DEFAULT_MAX_CTAS),
                         ("copy", True, src, record, pool, 3)]


@pytest.mark.parametrize(("name", "path"), [("cuda", "auto"), ("tile", "tile"), ("bulk", "bulk")])
def test_cuda_backends_hand_their_path_to_the_wrapper(monkeypatch, name, path):
    from megatron_paging.kernels import cuda_ops

    seen = []
    monkeypatch.setattr(cuda_ops, "copy", lambda *args: seen.append(args))
    src, record, pool = source(), small_record(), small_pool()
    REGISTRY[name].copy(True, src, record, pool, 9)
    REGISTRY[name].stash(src, record, pool)
    assert seen == [(True, src, record, pool, 9, path),
                    (False, src, record, pool, DEFAULT_MAX_CTAS, path)]


def test_round_trip_through_the_module_functions():
    pool, record = small_pool(), small_record(live=6)
    kernels.stash(source(), record, pool)
    assert record.page_record.tolist() == [0, 1, 0] and pool.free_pages() == (2, 2)
    dst = torch.full((ROWS, ROW_BYTES), 0xEE, dtype=torch.uint8)
    kernels.reload(dst, record, pool, backend="reference", max_ctas=1)
    assert torch.equal(dst[:6], source()[:6]) and bool((dst[6:] == 0xEE).all())
    assert pool.free_pages() == (4, 2)


# ----------------------------------------------------------------------------- prepare


def make_pools(*row_bytes) -> PagePools:
    pools = PagePools(PAGE_SIZE)
    for rb in row_bytes:
        pools.add(rb, cuda_rows=8)
    return pools


def test_prepare_calls_the_backends_pool_set_up_once_per_pool(spy):
    pools = make_pools(8, 16, 224)
    prepare(pools, "spy")
    assert spy.calls == [("prepare", pool) for pool in pools]


def test_prepare_without_set_up_does_nothing():
    pools = make_pools(8, 16)
    prepare(pools)  # auto on CPU: the reference needs nothing
    prepare(pools, "reference")
    assert all(pool.kernel_handle is None for pool in pools)


def test_prepare_refuses_a_backend_the_pools_cannot_use():
    with pytest.raises(ValueError, match="backend 'tile' runs on cuda tensors, got cpu"):
        prepare(make_pools(8), "tile")
    with pytest.raises(ValueError, match="must be one of"):
        prepare(make_pools(8), "triton")
    prepare(make_pools(), "tile")  # no pools: nothing to resolve


def test_cuda_pool_set_up_refuses_a_cpu_pool():
    """The CUDA backends' per-pool set-up (the kernels' handle) needs a CUDA pool; it says so
    without building the extension."""
    for name in ("cuda", "tile", "bulk"):
        with pytest.raises(ValueError, match="need a CUDA pool, got one on cpu"):
            REGISTRY[name].prepare_pool(small_pool())
