"""Strategies and the checking harness behind test_kernels_reference.py.

``Harness`` drives real pools and records through ``megatron_paging.kernels`` (any registered
backend: the reference, or on a CUDA pool the CUDA kernels' ``cuda`` / ``tile`` / ``bulk``) next
to the plain-Python ring model (``model_ring.py``) and checks, after every stash and reload, that
the two agree on page records, spill markers, rings, counters, flags and bytes (see the test
module's docstring for the full list).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from model_ring import DEVICE, HOST, ModelPool, ModelRecord

from megatron_paging import kernels
from megatron_paging.pages.pool import PagePool, PagingFlags
from megatron_paging.pages.record import PageRecord

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
        zeroed = set(model_pool.zeroed_rows(model)) if sticky_before is not None else set()
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
            if row in zeroed:  # overflowed step: live rows read as zeros, never as garbage
                assert got[row] == bytes(len(got[row]))
            else:
                assert got[row] == (src_rows[row] if row in live else poison_rows[row])
        PATHS["reload_copied" if copied else "reload_zeroed" if zeroed else "reload_noop"] += 1
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
            # The CUDA kernels' completion counter is back at 0 after every launch.
            assert pool.kernel_done_counter.tolist() == [0, 0]
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
