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

from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_ring import DEVICE, HOST, ModelFlags, ModelPool, ModelRecord, pages_for

from megatron_paging import kernels
from megatron_paging.pool import PagePool, PagePools, PagingFlags
from megatron_paging.record import PageRecord

DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int64,
    torch.uint8,
]
MAX_ROW_BYTES = 24
MAX_ROWS = 64
MAX_PAGES = 16
COUNTER_STARTS = st.one_of(
    st.just(0),
    st.integers(0, 1 << 12),
    st.integers((1 << 40) - 64, (1 << 40) + 64),
    st.integers((1 << 62) - 4096, 1 << 62),
)

EXAMPLES: Counter[str] = Counter()  # executed examples per @given test
PATHS: Counter[str] = Counter()  # how often each interesting path ran, for coverage checks


# ----------------------------------------------------------------------------- bytes helpers


def random_bytes(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with uniformly random bytes (NaN/Inf bit patterns included)."""
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def byte_rows(t: torch.Tensor) -> list[bytes]:
    """Rows of a 2-d tensor as raw bytes (viewing as uint8 scales the last dim to bytes)."""
    return [bytes(row) for row in t.contiguous().view(torch.uint8).cpu().numpy()]


# ----------------------------------------------------------------------------- strategies


@dataclass
class PoolSpec:
    dtype: torch.dtype
    cols: int
    num_cuda_pages: int
    num_host_pages: int
    heads: tuple[int, int]
    rings: tuple[list[int], list[int]]

    @property
    def row_bytes(self) -> int:
        return self.cols * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class RecordSpec:
    key: int  # index of the pool it belongs to
    capacity_rows: int
    segments: list[tuple[int, int]] | None  # None: one default segment
    live: list[int]
    live_dtype: torch.dtype
    seed: int


@st.composite
def row_layouts(draw):
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty((), dtype=dtype).element_size()
    return dtype, draw(st.integers(1, MAX_ROW_BYTES // size))


@st.composite
def pool_specs(draw, layout, host: bool | None = None, max_cuda_pages=MAX_PAGES, counters=True):
    dtype, cols = layout
    num_cuda = draw(st.integers(0, max_cuda_pages))
    has_host = draw(st.booleans()) if host is None else host
    num_host = draw(st.integers(1, MAX_PAGES)) if has_host else 0
    heads, rings = (0, 0), (list(range(num_cuda)), list(range(num_host)))
    if counters and draw(st.booleans()):
        heads = (draw(COUNTER_STARTS), draw(COUNTER_STARTS))
        rings = (draw(st.permutations(range(num_cuda))), draw(st.permutations(range(num_host))))
    return PoolSpec(dtype, cols, num_cuda, num_host, heads, rings)


@st.composite
def record_specs(draw, num_pools=1, allow_invalid=True):
    capacity = draw(st.integers(1, MAX_ROWS))
    segments = None
    if draw(st.booleans()):
        k = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, capacity), min_size=2 * k, max_size=2 * k)))
        segments = [(cuts[2 * i], cuts[2 * i + 1] - cuts[2 * i]) for i in range(k)]
    seg_rows = [capacity] if segments is None else [rows for _, rows in segments]
    return RecordSpec(
        key=draw(st.integers(0, num_pools - 1)),
        capacity_rows=capacity,
        segments=segments,
        live=draw(live_counts(seg_rows, allow_invalid)),
        live_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def live_counts(draw, seg_rows: list[int], allow_invalid: bool):
    live = [draw(st.integers(0, rows)) for rows in seg_rows]
    if allow_invalid and draw(st.integers(0, 40)) == 40:
        s = draw(st.integers(0, len(live) - 1))
        live[s] = draw(st.sampled_from([-1, -3, seg_rows[s] + 1, seg_rows[s] + 5]))
    return live


@st.composite
def replays(draw, records: list[RecordSpec], allow_invalid: bool):
    """A second iteration reusing every record object with new live counts and a new order."""
    lives = [
        draw(live_counts([rows for _, rows in r.segments or [(0, r.capacity_rows)]], allow_invalid))
        for r in records
    ]
    seeds = [draw(st.integers(0, 2**31 - 1)) for _ in records]
    return lives, seeds, draw(interleavings(len(records)))


@st.composite
def interleavings(draw, n: int):
    """Stashes in record order with reloads of any outstanding record interleaved anywhere."""
    ops, outstanding, next_stash = [], [], 0
    while next_stash < n or outstanding:
        if next_stash < n and (not outstanding or draw(st.booleans())):
            ops.append(("stash", next_stash))
            outstanding.append(next_stash)
            next_stash += 1
        else:
            k = draw(st.integers(0, len(outstanding) - 1))
            ops.append(("reload", outstanding.pop(k)))
    return ops


# ----------------------------------------------------------------------------- harness


def set_rings(pool: PagePool, heads, rings) -> None:
    caps = (pool.num_cuda_pages, pool.num_host_pages)
    pool.free_list_head.copy_(torch.tensor(heads))
    pool.free_list_tail.copy_(torch.tensor([heads[t] + caps[t] for t in (DEVICE, HOST)]))
    pool.free_list_cuda.copy_(torch.tensor(rings[DEVICE], dtype=torch.int64))
    pool.free_list_host.copy_(torch.tensor(rings[HOST], dtype=torch.int64))  # cross-device ok


STATE = ("free_list_head", "free_list_tail", "free_list_cuda", "free_list_host")
STATE += ("cuda_pages", "host_pages")


def pool_state(pool: PagePool) -> list[torch.Tensor]:
    return [getattr(pool, name).clone() for name in STATE]


class Harness:
    """Runs the same operations on real pools and on the model; checks after every step."""

    def __init__(
        self,
        pools: list[PagePool],
        models: list[ModelPool],
        flags: PagingFlags,
        backend: str = "auto",
        max_ctas: int | None = None,
    ):
        self.pools, self.models, self.flags = pools, models, flags
        self.backend, self.max_ctas = backend, max_ctas
        self.model_flags = models[0].flags
        assert all(m.flags is self.model_flags for m in models)
        self.initial_rings = [[sorted(m.tiers[t].ring) for t in (DEVICE, HOST)] for m in models]
        self.records: list[tuple[RecordSpec, PageRecord, ModelRecord, torch.Tensor]] = []
        self.superseded: set[int] = set()  # records whose object a later record reuses

    def add(self, spec: RecordSpec, dtype: torch.dtype, cols: int, reuse: int | None = None):
        """A new record; or, with ``reuse``, that record's object again with new live counts
        written in place (as a CUDA-graph replay would) once its previous use was reloaded."""
        pool = self.pools[spec.key]
        if reuse is not None:
            record = self.records[reuse][1]
            record.live_rows.copy_(torch.tensor(spec.live))
            self.superseded.add(reuse)
            PATHS["record_reused"] += 1
        else:
            live = torch.tensor(spec.live, dtype=spec.live_dtype, device=pool.device)
            if spec.segments is None and spec.seed % 2:
                live = live.reshape(())  # a 0-d live count is accepted for one segment
            record = PageRecord.new(
                spec.capacity_rows, pool.row_bytes, pool.page_size, live, spec.segments
            )
        segments = spec.segments or [(0, spec.capacity_rows)]
        model = ModelRecord(spec.capacity_rows, pool.page_size, segments, list(spec.live))
        src = random_bytes((spec.capacity_rows, cols), dtype, spec.seed).to(pool.device)
        self.records.append((spec, record, model, src))
        PATHS["multi_segment"] += len(segments) > 1

    def add_all(self, specs: list[RecordSpec], pools: PoolSpec | list[PoolSpec]) -> None:
        for spec in specs:
            pool = pools if isinstance(pools, PoolSpec) else pools[spec.key]
            self.add(spec, pool.dtype, pool.cols)

    def run(self, ops) -> None:
        outstanding = []
        for op, i in ops:
            if op == "stash":
                outstanding.append(i)
                self.stash(i)
            else:
                PATHS["reload_not_oldest_nor_newest"] += i not in (outstanding[0], outstanding[-1])
                outstanding.remove(i)
                self.reload(i)
        self.check_finished()

    def stash(self, i: int) -> None:
        spec, record, model, src = self.records[i]
        pool, model_pool = self.pools[spec.key], self.models[spec.key]
        sticky_before = self.snapshot_if_overflow()
        free_before = pool.free_pages()
        kernels.stash(src, record, pool, self.backend, self.max_ctas)
        model_pool.stash(model, byte_rows(src))

        assert record.page_record.tolist() == model.page_record, "page ids off the ring"
        assert int(record.spilled_to_host) == model.spilled_to_host
        self.check_rings_and_flags()
        self.check_sticky(sticky_before)
        if model.tier is not None:
            # The tier rule, from the real counters: host only when the device can't take it all.
            required = model.required
            if model.tier == HOST:
                assert free_before[DEVICE] < required <= free_before[HOST]
                assert self.flags.read()["host_spill"]
                PATHS["host_spill"] += 1
            else:
                assert free_before[DEVICE] >= required
            pages = pool.host_pages if model.tier == HOST else pool.cuda_pages
            src_rows = byte_rows(src)
            stored = byte_rows(pages)
            for src_row, slot, row_in_page in model.live_rows():
                pool_row = model.page_record[slot] * pool.page_size + row_in_page
                assert stored[pool_row] == src_rows[src_row], "stashed bytes not in their page"
        elif not model.valid:
            PATHS["invalid_live"] += 1
            with pytest.raises(ValueError, match="live_rows"):
                self.flags.raise_if_invalid()
        elif sticky_before is None:
            PATHS["overflow_on_stash"] += 1
        self.check_ownership()

    def reload(self, i: int) -> None:
        spec, record, model, src = self.records[i]
        pool, model_pool = self.pools[spec.key], self.models[spec.key]
        sticky_before = self.snapshot_if_overflow()
        poison = (~src.view(torch.uint8)).view(src.dtype)  # differs from src in every byte
        dst = poison.clone()
        expected = byte_rows(poison)
        copied = model_pool.reload(model, expected)
        kernels.reload(dst, record, pool, self.backend, self.max_ctas)

        got = byte_rows(dst)
        assert got == expected, "reload destination differs from the model"
        src_rows, poison_rows = byte_rows(src), byte_rows(poison)
        live = {row for row, _, _ in model.live_rows()} if copied else set()
        for row in range(spec.capacity_rows):
            assert got[row] == (src_rows[row] if row in live else poison_rows[row])
        PATHS["reload_copied" if copied else "reload_noop"] += 1
        self.check_rings_and_flags()
        self.check_sticky(sticky_before)
        self.check_ownership()

    def snapshot_if_overflow(self):
        if not self.flags.read()["overflow"]:
            return None
        return [pool_state(pool) for pool in self.pools]

    def check_sticky(self, before) -> None:
        if before is None:
            return
        PATHS["op_after_overflow"] += 1
        for pool, state in zip(self.pools, before, strict=True):
            for old, new in zip(state, pool_state(pool), strict=True):
                assert torch.equal(old, new), "an operation after overflow changed a pool"

    def check_rings_and_flags(self) -> None:
        assert self.flags.read() == self.model_flags.as_dict()
        for pool, model in zip(self.pools, self.models, strict=True):
            assert pool.free_list_head.tolist() == [model.tiers[t].head for t in (DEVICE, HOST)]
            assert pool.free_list_tail.tolist() == [model.tiers[t].tail for t in (DEVICE, HOST)]
            assert pool.free_list_cuda.tolist() == model.tiers[DEVICE].ring
            assert pool.free_list_host.tolist() == model.tiers[HOST].ring

    def check_ownership(self) -> None:
        """Every page: free, or owned by one un-reloaded record (real page records, real rings)."""
        for key, pool in enumerate(self.pools):
            for tier, ring in ((DEVICE, pool.free_list_cuda), (HOST, pool.free_list_host)):
                head, tail = (int(pool.free_list_head[tier]), int(pool.free_list_tail[tier]))
                ids = ring.tolist()
                free = [ids[(head + j) % len(ids)] for j in range(tail - head)]
                owned = []
                for i, (spec, record, model, _) in enumerate(self.records):
                    if spec.key != key or model.tier != tier:
                        continue
                    if i in self.superseded:  # kept pages after an overflow; its object moved on
                        owned += model.page_ids
                    else:
                        slots = record.page_record.tolist()
                        owned += [slots[s] for s in model.live_slots()]
                assert len(set(owned)) == len(owned), f"a tier-{tier} page has two owners"
                assert sorted(owned + free) == self.initial_rings[key][tier]

    def check_finished(self) -> None:
        if self.flags.read()["overflow"]:
            PATHS["finished_overflowed"] += 1
            return
        PATHS["finished_clean"] += 1
        for key, pool in enumerate(self.pools):
            heads, tails = pool.free_list_head.tolist(), pool.free_list_tail.tolist()
            for tier, ring in ((DEVICE, pool.free_list_cuda), (HOST, pool.free_list_host)):
                assert tails[tier] - heads[tier] == ring.numel()
                assert sorted(ring.tolist()) == self.initial_rings[key][tier]


def single_pool_harness(spec: PoolSpec, page_size: int, device="cpu", **kernel_args) -> Harness:
    pool = PagePool(spec.row_bytes, page_size, spec.num_cuda_pages, spec.num_host_pages, device)
    set_rings(pool, spec.heads, spec.rings)
    model = ModelPool(
        page_size, spec.num_cuda_pages, spec.num_host_pages, heads=spec.heads, rings=spec.rings
    )
    return Harness([pool], [model], pool.flags, **kernel_args)


# ----------------------------------------------------------------------------- properties


@st.composite
def single_pool_scenarios(draw, host=None, max_cuda_pages=MAX_PAGES, allow_invalid=True):
    spec = draw(pool_specs(draw(row_layouts()), host=host, max_cuda_pages=max_cuda_pages))
    page_size = draw(st.integers(1, 8))
    records = draw(st.lists(record_specs(allow_invalid=allow_invalid), min_size=1, max_size=8))
    return spec, page_size, records, draw(interleavings(len(records)))


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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["reference", "cuda"])
@settings(max_examples=300)
@given(single_pool_scenarios(), st.data())
def test_cuda_pool_matches_model(backend, scenario, data):
    """The same oracle on a CUDA pool (pinned host tier); the CUDA kernels with tiny grids too,
    so their grid-stride loops wrap. Not part of the CPU example budget."""
    max_ctas = data.draw(st.sampled_from([None, 1, 2, 7])) if backend == "cuda" else None
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
COVERED_PATHS += ("overflow_on_stash", "op_after_overflow", "reload_copied", "reload_noop")
COVERED_PATHS += ("reload_not_oldest_nor_newest", "finished_clean", "finished_overflowed")


def test_example_budget():
    """Runs last: >= 10,000 random sequences ran, and each interesting path was exercised."""
    if not GIVEN_TESTS <= set(EXAMPLES):
        pytest.skip(f"only {sorted(EXAMPLES)} of the @given tests ran in this session")
    total = sum(EXAMPLES.values())
    print(f"\nrandom sequences: {total} {dict(EXAMPLES)}\npaths: {dict(PATHS)}")
    assert total >= 10_000, f"only {total} random sequences ran"
    for path in COVERED_PATHS:
        assert PATHS[path] >= 100, f"path {path!r} ran only {PATHS[path]} times"
