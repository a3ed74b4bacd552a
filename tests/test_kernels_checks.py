"""``megatron_paging.kernels.checks``: every error of ``check_args`` and ``as_rows`` (exact
messages), that a rejected call changes nothing, and that the checks are free: ``check_args``
runs no tensor op and ``as_rows`` makes at most the byte view."""

from __future__ import annotations

import pytest
import torch
from op_counter import OpCounter

from megatron_paging import kernels
from megatron_paging.kernels.checks import as_rows, check_args
from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord

ROW_BYTES, PAGE_SIZE, ROWS = 8, 4, 10
WHAT = ["stash source", "reload destination"]


def small_pool(**kwargs) -> PagePool:
    args = dict(row_bytes=ROW_BYTES, page_size=PAGE_SIZE, num_cuda_pages=4, num_host_pages=2)
    return PagePool(**(args | kwargs))


def small_record(live=3, device="cpu", **kwargs) -> PageRecord:
    args = dict(capacity_rows=ROWS, row_bytes=ROW_BYTES, page_size=PAGE_SIZE)
    return PageRecord.new(**(args | kwargs), live_rows=torch.tensor(live, device=device))


def source(rows=ROWS, row_bytes=ROW_BYTES) -> torch.Tensor:
    return torch.arange(rows * row_bytes, dtype=torch.int32).to(torch.uint8).view(rows, row_bytes)


# ----------------------------------------------------------------------------- check_args


@pytest.mark.parametrize("what", WHAT)
def test_non_tensor_rejected(what):
    with pytest.raises(TypeError) as excinfo:
        check_args(source().numpy(), small_record(), small_pool(), what)
    assert str(excinfo.value) == f"{what} must be a tensor, got ndarray"


@pytest.mark.parametrize("what", WHAT)
def test_tensor_on_another_device_rejected(what):
    with pytest.raises(ValueError) as excinfo:
        check_args(source().to("meta"), small_record(), small_pool(), what)
    assert str(excinfo.value) == f"{what} is on meta but the pool is on cpu"
    with pytest.raises(ValueError) as excinfo:
        check_args(source(), small_record(device="meta"), small_pool(device="meta"), what)
    assert str(excinfo.value) == f"{what} is on cpu but the pool is on meta"


def test_record_on_another_device_rejected():
    with pytest.raises(ValueError) as excinfo:
        check_args(source(), small_record(device="meta"), small_pool(), "stash source")
    assert str(excinfo.value) == "record.live_rows is on meta but the pool is on cpu"


def test_record_row_bytes_mismatch_rejected():
    record = small_record(row_bytes=2 * ROW_BYTES)
    with pytest.raises(ValueError) as excinfo:
        check_args(source(ROWS, 2 * ROW_BYTES), record, small_pool(), "stash source")
    assert str(excinfo.value) == "record row_bytes=16 does not match the pool's 8"


def test_record_page_size_mismatch_rejected():
    with pytest.raises(ValueError) as excinfo:
        check_args(source(), small_record(page_size=2 * PAGE_SIZE), small_pool(), "stash source")
    assert str(excinfo.value) == "record page_size=8 does not match the pool's 4"


@pytest.mark.parametrize("what", WHAT)
def test_non_contiguous_tensor_rejected(what):
    wide = source(ROWS, 2 * ROW_BYTES)
    with pytest.raises(ValueError) as excinfo:
        check_args(wide[:, ::2], small_record(), small_pool(), what)
    assert str(excinfo.value) == f"{what} must be contiguous (got strides (16, 2))"


@pytest.mark.parametrize("rows", [ROWS - 1, ROWS + 1])
@pytest.mark.parametrize("what", WHAT)
def test_wrong_byte_size_rejected(what, rows):
    with pytest.raises(ValueError) as excinfo:
        check_args(source(rows), small_record(), small_pool(), what)
    assert str(excinfo.value) == (
        f"{what} holds {rows * ROW_BYTES} bytes (({rows}, 8) torch.uint8) but the record needs "
        "10 rows x 8 bytes = 80"
    )


def test_checks_run_in_a_fixed_order():
    """The first failing check is the one reported: type, device, record device, row bytes,
    page size, contiguity, size."""
    bad_everything = source(ROWS + 1, 2 * ROW_BYTES)[:, ::2].to("meta")
    record = small_record(device="meta", page_size=2)
    with pytest.raises(ValueError, match="stash source is on meta"):
        check_args(bad_everything, record, small_pool(), "stash source")
    with pytest.raises(ValueError, match="record.live_rows is on meta"):
        check_args(source(ROWS + 1)[:, ::2], record, small_pool(), "stash source")
    record = small_record(row_bytes=4, page_size=2)
    with pytest.raises(ValueError, match="record row_bytes=4"):
        check_args(source(ROWS + 1)[:, ::2], record, small_pool(), "stash source")
    with pytest.raises(ValueError, match="record page_size=2"):
        check_args(source(ROWS + 1)[:, ::2], small_record(page_size=2), small_pool(), "x")
    with pytest.raises(ValueError, match="x must be contiguous"):
        check_args(source(ROWS + 1, 16)[:, ::2], small_record(), small_pool(), "x")


@pytest.mark.parametrize(
    "make",
    [
        lambda: source().view(torch.float8_e5m2),
        lambda: source().view(torch.bfloat16),
        lambda: source().view(torch.float32).reshape(ROWS, 2),
        lambda: source().view(torch.int64).reshape(-1),
        lambda: source().reshape(2, 5, ROW_BYTES),
    ],
    ids=["fp8", "bf16", "fp32", "int64_flat", "uint8_3d"],
)
def test_same_bytes_in_any_dtype_or_shape_accepted(make):
    tensor, record, pool = make(), small_record(), small_pool()
    with OpCounter() as ops:
        check_args(tensor, record, pool, "stash source")
    assert ops.views == ops.allocations == ops.writes == []  # attribute reads only


def test_same_bytes_in_another_dtype_round_trip():
    pool, record = small_pool(), small_record(live=5)
    src = source().view(torch.float8_e5m2)
    kernels.stash(src.view(torch.bfloat16), record, pool)
    dst = torch.zeros(ROWS * ROW_BYTES, dtype=torch.float8_e4m3fn)
    kernels.reload(dst, record, pool)
    assert torch.equal(dst.view(torch.uint8).view(ROWS, ROW_BYTES)[:5], source()[:5])
    assert bool((dst.view(torch.uint8)[5 * ROW_BYTES :] == 0).all())


def test_rejected_call_changes_nothing():
    pool, record = small_pool(), small_record(live=5)
    record.page_record.fill_(7)
    before = [t.clone() for t in (pool.free_list_head, pool.free_list_tail, pool.free_list_cuda,
                                  pool.flags.values, pool.cuda_pages)]
    for op, tensor in ((kernels.stash, source(ROWS + 1)), (kernels.reload, source()[:, ::2])):
        with pytest.raises(ValueError, match="holds|contiguous"):
            op(tensor, record, pool)
    after = (pool.free_list_head, pool.free_list_tail, pool.free_list_cuda, pool.flags.values,
             pool.cuda_pages)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert record.page_record.tolist() == [7] * record.page_record.numel()


@pytest.mark.parametrize("op", ["stash", "reload"])
def test_the_reference_backend_runs_the_shared_checks(op, monkeypatch):
    seen = []
    import megatron_paging.kernels.reference as reference

    def spy(t, record, pool, what):
        seen.append(what)
        raise ValueError("checked")

    monkeypatch.setattr(reference, "check_args", spy)
    with pytest.raises(ValueError, match="checked"):
        getattr(kernels, op)(source(), small_record(), small_pool(), backend="reference")
    assert seen == ["stash source" if op == "stash" else "reload destination"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_tensors_with_a_cuda_pool_rejected():
    pool = small_pool(device="cuda")
    cuda_record = small_record(device="cuda")
    with pytest.raises(ValueError, match="stash source is on cpu but the pool is on cuda:"):
        kernels.stash(source(), cuda_record, pool, backend="reference")
    with pytest.raises(ValueError, match="record.live_rows is on cpu but the pool is on cuda:"):
        kernels.stash(source().cuda(), small_record(), pool, backend="reference")


# ----------------------------------------------------------------------------- as_rows


def test_as_rows_rejects_non_contiguous():
    with pytest.raises(ValueError) as excinfo:
        as_rows(source(ROWS, 16)[:, ::2], ROWS, ROW_BYTES, "parked tensor")
    assert str(excinfo.value) == "parked tensor must be contiguous (got strides (16, 2))"


def test_as_rows_rejects_a_wrong_size():
    with pytest.raises(ValueError) as excinfo:
        as_rows(torch.zeros(3, 5, dtype=torch.bfloat16), 4, 8, "unparked tensor")
    assert str(excinfo.value) == (
        "unparked tensor holds 30 bytes ((3, 5) torch.bfloat16) but the record needs "
        "4 rows x 8 bytes = 32"
    )


@pytest.mark.parametrize(
    ("make", "views"),
    [
        (lambda: torch.zeros(ROWS, 32, dtype=torch.uint8), 0),  # already byte rows
        (lambda: torch.zeros(ROWS, 8), 1),  # one dtype view
        (lambda: torch.zeros(ROWS, 2, 4, requires_grad=True), 2),  # dtype + rows
        (lambda: torch.zeros(ROWS * 32, dtype=torch.uint8), 1),  # bytes, rows view only
        (lambda: torch.zeros(ROWS, 16, dtype=torch.bfloat16), 1),
        (lambda: torch.zeros(ROWS * 4, dtype=torch.int64), 2),
        (lambda: torch.zeros(ROWS, 32, dtype=torch.float8_e4m3fn), 1),
    ],
    ids=["uint8_rows", "fp32_rows", "fp32_3d_grad", "uint8_flat", "bf16_rows", "int64_flat",
         "fp8_rows"],
)
def test_as_rows_makes_at_most_the_byte_view(make, views):
    tensor = make()
    with OpCounter() as ops:
        rows = as_rows(tensor, ROWS, 32, "src")
    assert len(ops.views) == views, ops.views
    assert ops.allocations == [] and ops.writes == []
    assert rows.shape == (ROWS, 32) and rows.dtype == torch.uint8
    assert rows.data_ptr() == tensor.data_ptr() and not rows.requires_grad
    if views == 0:
        assert rows is tensor


def test_as_rows_is_a_view_of_the_same_bytes():
    tensor = torch.arange(ROWS * 8, dtype=torch.float32).view(ROWS, 8)
    rows = as_rows(tensor, ROWS, 32, "src")
    assert torch.equal(rows[3], tensor[3:4].view(torch.uint8).reshape(-1))
    rows[0].fill_(0)
    assert tensor[0].eq(0).all() and tensor[1].ne(0).all()


@pytest.mark.parametrize(("rows", "row_bytes"), [(1, 4), (2, 2), (4, 1)])
def test_as_rows_of_a_0d_tensor(rows, row_bytes):
    """A 0-d tensor cannot change dtype directly; it still comes back as its own bytes."""
    tensor = torch.tensor(1.5)
    with OpCounter() as ops:
        out = as_rows(tensor, rows, row_bytes, "src")
    assert out.shape == (rows, row_bytes) and out.dtype == torch.uint8
    assert out.data_ptr() == tensor.data_ptr() and ops.allocations == [] and ops.writes == []
    assert out.reshape(-1).view(torch.float32).item() == 1.5
