"""Property-based tests of the reference stash/reload against the plain-Python ring model.

Every example builds one or two CPU pools and a handful of records (random dtypes, row byte
counts, segment layouts, live counts, page sizes, pool sizes, host tier or not, ring counters
near 2^40 / 2^62, shuffled rings), then runs a random interleaving of stashes and reloads —
reloads in any order — checking after every operation:

* page records, spill markers, ring contents, head/tail counters and flags equal the model's
  (FIFO pops in record order, pushes in record order, host tier only for a whole record that
  the device tier cannot hold, sticky overflow, invalid live counts);
* stashed bytes sit in the pool rows the page record names; reloaded live rows are
  byte-identical to the source and every other destination byte keeps its (poisoned) value;
* every page of a tier is either free or owned by exactly one un-reloaded record;
* once overflow is set, nothing in any pool (rings, counters, pages) changes;
* with everything reloaded and no overflow, each ring holds its initial multiset again.

Example budget: the @given tests' max_examples add up to ``EXAMPLE_BUDGET`` (>= 10,000);
``test_example_budget`` runs last and checks the executed count and path coverage.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cuda_twin import needs_sm90, on_gpu, require_bulk
from hypothesis import given, settings
from hypothesis import strategies as st
from model_ring import DEVICE, ModelFlags, ModelPool, ModelRecord, pages_for
from paging_harness import (
    EXAMPLES,
    MAX_ROWS,
    PATHS,
    Harness,
    RecordSpec,
    byte_rows,
    interleavings,
    pool_specs,
    record_specs,
    replays,
    row_layouts,
    set_rings,
    single_pool_harness,
    single_pool_scenarios,
)

from megatron_paging import kernels
from megatron_paging.pages.pool import PagePool, PagePools
from megatron_paging.pages.record import PageRecord

pytestmark = pytest.mark.long_cpu  # about 190 s on one 2-core worker: started first


@settings(max_examples=4000)
@given(single_pool_scenarios(), st.data())
def test_random_interleavings_match_model(scenario, data):
    """Plus, half the time, a second iteration that reuses the record objects (new live counts)
    on the rings as the first left them."""
    EXAMPLES["interleavings"] += 1
    run_with_replay(single_pool_harness(scenario[0], scenario[1]), scenario, data)


def run_with_replay(harness: Harness, scenario, data) -> None:
    spec, _, records, ops = scenario
    harness.add_all(records, spec)
    harness.run(ops)
    if data.draw(st.booleans()):
        lives, seeds, replay_ops = data.draw(replays(records, allow_invalid=True))
        for i, (r, live, seed) in enumerate(zip(records, lives, seeds, strict=True)):
            harness.add(replace(r, live=live, seed=seed), spec.dtype, spec.cols, reuse=i)
        harness.run([(op, i + len(records)) for op, i in replay_ops])


@settings(max_examples=2000)
@given(single_pool_scenarios(host=True, max_cuda_pages=4, allow_invalid=False))
def test_host_tier_takes_whole_records_the_device_cannot(scenario):
    EXAMPLES["host_tier"] += 1
    spec, page_size, records, ops = scenario
    harness = single_pool_harness(spec, page_size)
    harness.add_all(records, spec)
    harness.run(ops)


@settings(max_examples=2000)
@given(single_pool_scenarios(allow_invalid=False), st.data())
def test_overflow_and_invalid_live_are_sticky(scenario, data):
    """A record that cannot fit (or has a bad live count) lands mid-sequence; the rest no-ops."""
    EXAMPLES["sticky"] += 1
    spec, page_size, records, ops = scenario
    total_pages = spec.num_cuda_pages + spec.num_host_pages
    invalid = data.draw(st.booleans())
    if invalid:
        live = data.draw(st.sampled_from([-1, MAX_ROWS + 1]))
    else:  # MAX_ROWS live rows need more pages than both tiers hold together
        live = MAX_ROWS
        page_size = max(1, min(page_size, MAX_ROWS // (total_pages + 1)))
        assert pages_for(MAX_ROWS, page_size) > total_pages
    harness = single_pool_harness(spec, page_size)
    harness.add_all(records, spec)
    trigger = RecordSpec(0, MAX_ROWS, None, [live], torch.int64, data.draw(st.integers(0, 99)))
    harness.add(trigger, spec.dtype, spec.cols)
    stash_positions = [k for k, (op, _) in enumerate(ops) if op == "stash"] + [len(ops)]
    at = data.draw(st.sampled_from(stash_positions))
    ops = ops[:at] + [("stash", len(records))] + ops[at:] + [("reload", len(records))]
    harness.run(ops)
    assert harness.flags.read()["overflow"]
    assert harness.flags.read()["invalid_live"] == invalid


@settings(max_examples=1000)
@given(
    st.data(),
    st.integers((1 << 40) - 4096, (1 << 40) + 4096),
    st.integers((1 << 40) - 4096, (1 << 40) + 4096),
)
def test_ring_counters_near_2_pow_40(data, device_head, host_head):
    """64-bit counters: ring positions are counter mod capacity, with no wrap of the counter."""
    EXAMPLES["large_counters"] += 1
    spec = data.draw(pool_specs(data.draw(row_layouts()), counters=False))
    spec.heads = (device_head, host_head)
    spec.rings = (
        data.draw(st.permutations(range(spec.num_cuda_pages))),
        data.draw(st.permutations(range(spec.num_host_pages))),
    )
    page_size = data.draw(st.integers(1, 8))
    records = data.draw(st.lists(record_specs(allow_invalid=False), min_size=1, max_size=6))
    harness = single_pool_harness(spec, page_size)
    harness.add_all(records, spec)
    harness.run(data.draw(interleavings(len(records))))


@settings(max_examples=1500)
@given(st.data())
def test_pools_of_one_context_share_sticky_flags(data):
    """Two row sizes in one PagePools: an overflow in either freezes both."""
    EXAMPLES["two_pools"] += 1
    layout_a = data.draw(row_layouts())
    bytes_of = lambda layout: layout[1] * torch.empty((), dtype=layout[0]).element_size()
    layout_b = data.draw(row_layouts().filter(lambda lay: bytes_of(lay) != bytes_of(layout_a)))
    page_size = data.draw(st.integers(1, 8))
    pools = PagePools(page_size)
    specs, models, flags = [], [], ModelFlags()
    for layout in (layout_a, layout_b):
        spec = data.draw(pool_specs(layout, counters=False))
        pools.add(spec.row_bytes, spec.num_cuda_pages * page_size, spec.num_host_pages * page_size)
        specs.append(spec)
        models.append(ModelPool(page_size, spec.num_cuda_pages, spec.num_host_pages, flags))
    harness = Harness([pools[s.row_bytes] for s in specs], models, pools.flags)
    records = data.draw(st.lists(record_specs(num_pools=2), min_size=1, max_size=8))
    harness.add_all(records, specs)
    harness.run(data.draw(interleavings(len(records))))
    pools.reset()
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}
    assert [p.free_pages() for p in pools] == [(s.num_cuda_pages, s.num_host_pages) for s in specs]


@on_gpu
@pytest.mark.parametrize(
    "backend", ["reference", "cuda", "tile", pytest.param("bulk", marks=needs_sm90)]
)
@settings(max_examples=300)
@given(single_pool_scenarios(), st.data())
def test_cuda_pool_matches_model(backend, scenario, data):
    """The same oracle on a CUDA pool (pinned host tier), through the reference and both CUDA
    copy paths (the bulk one forced even for unaligned rows and the host tier, which it moves
    cooperatively); the CUDA kernels with tiny grids too, so their grid-stride loops wrap. Not
    part of the CPU example budget."""
    if backend == "bulk":
        require_bulk()
    max_ctas = data.draw(st.sampled_from([None, 1, 2, 7])) if backend != "reference" else None
    harness = single_pool_harness(
        scenario[0], scenario[1], "cuda", backend=backend, max_ctas=max_ctas
    )
    run_with_replay(harness, scenario, data)


EXAMPLE_BUDGET = 4000 + 2000 + 2000 + 1000 + 1500
assert EXAMPLE_BUDGET >= 10_000


# ----------------------------------------------------------------------------- worked examples


def test_fifo_worked_example_matches_model_and_reference():
    """Hand-computed page ids, so the model itself is checked against known numbers."""
    pool, model = PagePool(row_bytes=2, page_size=2, num_cuda_pages=4), ModelPool(2, 4)
    src = torch.arange(12, dtype=torch.uint8).view(6, 2)
    real, modeled = {}, {}

    def stash(name: str, live: int) -> None:
        real[name] = PageRecord.new(6, 2, 2, torch.tensor(live))
        modeled[name] = ModelRecord(6, 2, [(0, 6)], [live])
        kernels.stash(src, real[name], pool)
        model.stash(modeled[name], byte_rows(src))

    stash("a", 3)
    stash("b", 2)
    kernels.reload(torch.zeros_like(src), real["a"], pool)  # pushes 0, 1 at positions 4, 5
    model.reload(modeled["a"], byte_rows(src))
    stash("c", 5)
    # 3 slots per record; c pops position 3, then 4 and 5 where a's pages went back.
    for name, ids in {"a": [0, 1, 0], "b": [2, 0, 0], "c": [3, 0, 1]}.items():
        assert real[name].page_record.tolist() == modeled[name].page_record == ids
    assert pool.free_list_head.tolist() == [6, 0] and pool.free_list_tail.tolist() == [6, 0]
    assert pool.free_list_cuda.tolist() == model.tiers[DEVICE].ring == [0, 1, 2, 3]


def test_counters_near_2_pow_40_worked_example():
    """Head 2^40 + 3 on a 4-page ring starts at position 3 and wraps to 0 (64-bit arithmetic)."""
    head = (1 << 40) + 3
    pool = PagePool(row_bytes=1, page_size=1, num_cuda_pages=4)
    set_rings(pool, (head, 0), ([2, 0, 3, 1], []))
    record = PageRecord.new(2, 1, 1, torch.tensor(2))
    src = torch.tensor([[7], [9]], dtype=torch.uint8)
    kernels.stash(src, record, pool)
    assert record.page_record.tolist() == [1, 2]  # positions 3 and 0
    assert pool.free_list_head.tolist() == [head + 2, 0]
    dst = torch.zeros_like(src)
    kernels.reload(dst, record, pool)
    assert torch.equal(dst, src)
    assert pool.free_list_tail.tolist() == [head + 4 + 2, 0]
    assert pool.free_list_cuda.tolist() == [2, 0, 3, 1]  # pushed back at positions 3, 0


# ----------------------------------------------------------------------------- budget


GIVEN_TESTS = {"interleavings", "host_tier", "sticky", "large_counters", "two_pools"}
COVERED_PATHS = ("multi_segment", "record_reused", "host_spill", "invalid_live")
COVERED_PATHS += ("overflow_on_stash", "op_after_overflow", "reload_copied", "reload_zeroed")
COVERED_PATHS += ("reload_not_oldest_nor_newest", "finished_clean", "finished_overflowed")


def test_example_budget():
    """Runs last: >= 10,000 random sequences ran, and each interesting path was exercised."""
    if not GIVEN_TESTS <= set(EXAMPLES):
        pytest.skip(f"only {sorted(EXAMPLES)} of the @given tests ran in this run")
    total = sum(EXAMPLES.values())
    print(f"\nrandom sequences: {total} {dict(EXAMPLES)}\npaths: {dict(PATHS)}")
    assert total >= 10_000, f"only {total} random sequences ran"
    for path in COVERED_PATHS:
        assert PATHS[path] >= 100, f"path {path!r} ran only {PATHS[path]} times"
