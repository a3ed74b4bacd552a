"""CPU tests of the FIFO paging-stream scheduler, driven by real pipeline schedule orders."""

from __future__ import annotations

import warnings
from collections import defaultdict

import pytest
import torch
from capture import CapturingBackend
from cases import SCHEDULE_CASES

from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.runtime.streams import COMPUTE, PAGING, CpuStreamBackend
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule
from megatron_paging.tools.pipeline_sim import synthetic_chunks as make_chunks

pytest.importorskip("megatron.core", reason="Megatron-Core's schedule orders need megatron-core")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron_paging.mcore import op_order

TOKENS, HIDDEN, FFN, SEGMENTS, LAYERS, PAGE = 32, 16, 24, 2, 2, 4


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def paged_context(backend, pools, **options) -> PagingContext:
    config = PagingConfig(page_size=PAGE, **options)
    return PagingContext(PagingEngine(config, stream_backend=backend, pools=pools))


def make_pools(pages_rows: int = 4096) -> PagePools:
    pools = PagePools(PAGE)
    for row_bytes in (HIDDEN * 4, FFN * 4):
        pools.add(row_bytes, cuda_rows=pages_rows)
    return pools


def run(ops, num_chunks, paged=True, seed=3, layers=LAYERS, **options):
    chunks = make_chunks(num_chunks, layers, TOKENS, HIDDEN, FFN, SEGMENTS, seed=seed)
    backend, pools, context, op_starts = CpuStreamBackend(), None, PagingContext(None), []
    if paged:
        pools = options.pop("pools", None) or make_pools()
        context = paged_context(backend, pools, **options)
    on_op = lambda i, op: op_starts.append((len(backend.log), op))
    left = run_schedule(chunks, ops, context, (TOKENS, HIDDEN), seed=seed, on_op=on_op)
    return parameter_grads(chunks), backend, pools, left, op_starts


def assert_bitwise(control, paged):
    assert control.keys() == paged.keys() and control
    for name in control:
        assert torch.equal(control[name], paged[name]), f"gradient {name} differs"


def reload_events(log):
    """record id -> the reload-done event id its reload was followed by."""
    events, waiting = {}, []
    for e in log:
        if e.op == "launch" and e.kind == "reload":
            waiting.append(e.info["record"])
        elif e.op == "record" and e.kind == "reload-done":
            events.update({r: e.event for r in waiting})
            waiting = []
    return events


def check_log(backend, ops):
    log = backend.log
    launches = [e for e in log if e.op == "launch"]
    assert launches and all(e.stream == PAGING for e in launches)

    # Per-slot FIFO: a slot reloads its microbatches in the order it stashed them.
    stashed, reloaded = defaultdict(list), defaultdict(list)
    for e in launches:
        key = (e.info["chunk"], e.info["layer"], e.info.get("branch", "backward"))
        if e.kind == "stash":
            if e.info["microbatch"] not in stashed[key[:2]]:
                stashed[key[:2]].append(e.info["microbatch"])
        elif e.info["microbatch"] not in reloaded[key]:
            reloaded[key].append(e.info["microbatch"])
            assert e.info["oldest"], f"reload of {key} mb {e.info['microbatch']} skipped older"
    for (chunk, layer, _), order in reloaded.items():
        assert order == [m for m in stashed[(chunk, layer)] if m in order]
    assert sum(len(v) for k, v in reloaded.items() if k[2] == "backward") == sum(
        len(v) for v in stashed.values()
    )

    # Freelist mutations happen in issue order: each launch starts where the previous one on
    # the same pool ended; stash only moves heads, reload only tails.
    for e in launches:
        (head0, tail0), (head1, tail1) = e.info["before"], e.info["after"]
        if e.kind == "stash":
            assert tail1 == tail0 and head1[0] >= head0[0]
        else:
            assert head1 == head0 and tail1[0] >= tail0[0]
    by_pool = defaultdict(list)
    for e in launches:
        by_pool[e.info["pool_key"]].append(e)
    for entries in by_pool.values():
        for prev, nxt in zip(entries, entries[1:], strict=False):
            assert prev.info["after"] == nxt.info["before"]

    # Stash of a record is issued only after its slot's commit, behind a paging-stream wait.
    committed, waited_after_commit = set(), False
    for e in log:
        if e.op == "note" and e.kind == "commit":
            committed.update(e.info["records"])
            waited_after_commit = False
        elif e.op == "wait" and e.stream == PAGING and e.kind == "commit":
            waited_after_commit = True
        elif e.op == "launch" and e.kind == "stash":
            assert e.info["record"] in committed and waited_after_commit

    # Late waits: the compute stream waits on a reload group's event only right after
    # autograd's first unpack of one of its records, once per group (the group's records share
    # the event); every other record of the group is unpacked after that wait.
    events = reload_events(log)
    by_event = defaultdict(set)
    for r, ev in events.items():
        by_event[ev].add(r)
    compute_waits = [(i, e) for i, e in enumerate(log) if e.op == "wait" and e.stream == COMPUTE]
    unpack_waits = [(i, e) for i, e in compute_waits if e.event in by_event]
    assert unpack_waits
    wait_at = {}
    for i, e in unpack_waits:
        assert e.kind == "unpack"
        before = log[i - 1]
        assert before.op == "note" and before.kind == "unpack"
        assert events[before.info["record"]] == e.event and e.event not in wait_at
        wait_at[e.event] = i
    assert set(wait_at) == set(by_event), "every reload group is waited on, at its first unpack"
    unpacked = {}
    for i, e in enumerate(log):
        if e.op == "note" and e.kind == "unpack" and e.info["record"] in events:
            unpacked.setdefault(e.info["record"], i)
    assert set(unpacked) == set(events), "every reloaded record is unpacked"
    assert all(i >= wait_at[events[r]] - 1 for r, i in unpacked.items())
    assert len(wait_at) < len(events) or all(len(v) == 1 for v in by_event.values())
    assert not [e for e in launches if e.info.get("reason") == "demand"]
    assert [e for e in launches if e.info.get("reason") == "prefetch"]

    # Deferred wgrad: wgrad-only records of a deferring backward reload in the wgrad branch.
    deferred = {(op.chunk, op.microbatch) for op in ops if op.kind == "B" and op.defers_wgrad}
    for e in launches:
        if e.kind != "reload":
            continue
        is_deferred = e.info["wgrad_only"] and (e.info["chunk"], e.info["microbatch"]) in deferred
        assert e.info["branch"] == ("wgrad" if is_deferred else "backward")


def build(schedule, options):
    options = dict(options)
    if schedule == "1f1b":
        return op_order.one_f_one_b(**options), 1
    if schedule == "interleaved":
        return op_order.interleaved_one_f_one_b(**options), options["vpp"]
    return op_order.dualpipev(**options), 2


@pytest.mark.parametrize("schedule,options", SCHEDULE_CASES, ids=lambda v: str(v))
def test_schedule_parity_and_log(schedule, options):
    ops, num_chunks = build(schedule, options)
    control, *_ = run(ops, num_chunks, paged=False)
    paged, backend, pools, left, _ = run(ops, num_chunks)
    assert_bitwise(control, paged)
    assert left == 0
    for pool in pools:
        assert pool.free_pages() == (pool.num_cuda_pages, 0)
    assert not pools.flags.read()["overflow"]
    check_log(backend, ops)


def test_dualpipev_wgrad_records_stay_resident_until_w():
    ops = op_order.dualpipev(pp=2, rank=1, microbatches=5)
    _, backend, _, left, op_starts = run(ops, 2)
    assert left == 0
    # Log ranges of each executed step; an overlapped F+B pair is one step.
    ends = [start for start, _ in op_starts[1:]] + [len(backend.log)]
    steps = [(start, end, op) for (start, op), end in zip(op_starts, ends, strict=True)]
    b_step, w_step = {}, {}
    for index, (_, _, op) in enumerate(steps):
        position = ops.index(op)
        members = [op, ops[position + 1]] if op.overlap else [op]
        for member in members:
            key = (member.chunk, member.microbatch)
            if member.kind == "B" and member.defers_wgrad:
                b_step[key] = index
            if member.kind == "W":
                w_step[key] = index
    wgrad_reloads = [e for e in backend.entries("launch", "reload") if e.info["branch"] == "wgrad"]
    assert wgrad_reloads and b_step.keys() == w_step.keys()
    for e in wgrad_reloads:
        key = (e.info["chunk"], e.info["microbatch"])
        # Pages stay resident through the input-only backward; they reload at the earliest in
        # the step before the W op (op-level prefetch), and never during the B.
        assert e.seq >= steps[b_step[key]][1]
        assert e.seq >= steps[w_step[key] - 1][0]
        assert e.seq < steps[w_step[key]][1]


@pytest.mark.parametrize("distance", [0, 2])
def test_prefetch_distance(distance):
    ops = op_order.interleaved_one_f_one_b(pp=2, vpp=2, rank=0, microbatches=4)
    control, *_ = run(ops, 2, paged=False)
    paged, backend, _, left, _ = run(ops, 2, prefetch_distance=distance)
    assert_bitwise(control, paged)
    assert left == 0
    reasons = {e.info["reason"] for e in backend.entries("launch", "reload")}
    assert ("prefetch" in reasons) == (distance > 0)


DEEP = [  # more than two layers per chunk: which lower slots a prefetch picks matters
    ("1f1b", dict(pp=2, rank=0, microbatches=3)),
    ("interleaved", dict(pp=2, vpp=2, rank=1, microbatches=4)),
    ("dualpipev", dict(pp=2, rank=1, microbatches=5)),  # deferred wgrads: the W branch too
]


@pytest.mark.parametrize("distance", [1, 2])
@pytest.mark.parametrize("schedule,options", DEEP, ids=lambda v: str(v))
def test_prefetch_reloads_the_next_slots_below_in_descending_order(schedule, options, distance):
    """Slot ``l`` reloads when the backward (or wgrad) of slot ``l + distance`` starts, before
    slot ``l + distance - 1`` starts; the top slots by the op-level prefetch or the top slot's
    start. Taking the lowest slots first would reload slot 0 early and slot 2 at its start."""
    layers, (ops, num_chunks) = 4, build(schedule, options)
    control, *_ = run(ops, num_chunks, paged=False, layers=layers)
    paged, backend, _, left, _ = run(ops, num_chunks, layers=layers, prefetch_distance=distance)
    assert_bitwise(control, paged)
    assert left == 0
    starts, ends, reloads = {}, {}, {}
    for e in backend.log:
        info = e.info
        if e.op == "note" and e.kind in ("backward-slot-start", "wgrad-slot-start"):
            key = (e.kind.split("-")[0], info["chunk"], info["microbatch"], info["layer"])
            starts.setdefault(key, e.seq)
        elif e.op == "note" and e.kind == "backward-slot-end":
            ends.setdefault(("backward", info["chunk"], info["microbatch"], info["layer"]), e.seq)
        elif e.op == "launch" and e.kind == "reload":
            key = (info["branch"], info["chunk"], info["microbatch"], info["layer"])
            reloads.setdefault(key, (e.seq, info["reason"]))
    assert reloads.keys() == starts.keys()
    assert {k[0] for k in reloads} == ({"backward", "wgrad"} if schedule == "dualpipev"
                                       else {"backward"})
    for (branch, chunk, mb, layer), (seq, reason) in reloads.items():
        start = starts[(branch, chunk, mb, layer)]
        if layer == layers - 1:  # the top slot: ahead of its backward when an op allowed it
            assert (reason, seq < start) in {("prefetch", True), ("slot", False)}
            continue
        assert reason == "prefetch" and seq < start, (branch, chunk, mb, layer)
        if layer + distance < layers:  # issued inside the backward of the slot `distance` above
            upper = starts[(branch, chunk, mb, layer + distance)]
            below = starts[(branch, chunk, mb, layer + distance - 1)]
            assert upper < seq < below, (branch, chunk, mb, layer)
            if branch == "backward":  # group_start slots: at its end (the slot-end rule)
                assert ends[(branch, chunk, mb, layer + distance)] < seq, (chunk, mb, layer)
    # Between two scheduler milestones, the slots of one backward reload top down.
    issued, descending = defaultdict(list), 0
    for e in backend.log:
        if e.op == "note":
            issued.clear()
        elif e.op == "launch" and e.kind == "reload":
            seen = issued[(e.info["branch"], e.info["chunk"], e.info["microbatch"])]
            assert not seen or seen[-1] >= e.info["layer"]
            descending += bool(seen) and seen[-1] > e.info["layer"]
            seen.append(e.info["layer"])
    assert descending or distance == 1  # distance 2: the op-level prefetch reloads 2 slots


def test_no_overlap_control_runs_on_compute_stream():
    ops = op_order.one_f_one_b(pp=2, rank=0, microbatches=3, delay_wgrad=True)
    control, *_ = run(ops, 1, paged=False)
    paged, backend, pools, left, _ = run(ops, 1, overlap=False)
    assert_bitwise(control, paged)
    launches = backend.entries("launch")
    assert launches and all(e.stream == COMPUTE for e in launches)
    assert not [e for e in backend.log if e.op in ("wait", "record")]
    assert left == 0 and all(p.free_pages()[0] == p.num_cuda_pages for p in pools)


class CloneParker:
    """A stand-in calibration parker: keeps a compact copy of each segment's live prefix."""

    def __init__(self):
        self.parked_rows = 0

    def park(self, tensor, record):
        rows = tensor.reshape(record.capacity_rows, -1)
        live = record.live_rows.tolist()
        parts = [rows[s : s + n].clone() for s, n in zip(record.segment_starts, live, strict=True)]
        self.parked_rows += sum(live)
        return parts, tensor.shape

    def unpark(self, parked, record):
        parts, shape = parked
        out = torch.full(shape, float("nan"), dtype=parts[0].dtype)
        rows = out.view(record.capacity_rows, -1)
        for start, part in zip(record.segment_starts, parts, strict=True):
            rows[start : start + part.shape[0]] = part
        return out


class ParkerEngine(PagingEngine):
    """An engine whose (pool-less) steps park records with a given parker."""

    def __init__(self, parker):
        super().__init__(PagingConfig(page_size=PAGE), stream_backend=CpuStreamBackend())
        self.parker = parker

    def scheduler_for(self, device):
        self.scheduler = self.scheduler or PagingScheduler(
            self._stream_backend, pools=None, parker=self.parker, config=self.config
        )
        return self.scheduler


def test_parker_path_without_pools():
    ops = op_order.dualpipev(pp=2, rank=0, microbatches=4)
    control, *_ = run(ops, 2, paged=False)
    parker = CloneParker()
    chunks = make_chunks(2, LAYERS, TOKENS, HIDDEN, FFN, SEGMENTS, seed=3)
    left = run_schedule(chunks, ops, PagingContext(ParkerEngine(parker)), (TOKENS, HIDDEN), seed=3)
    assert_bitwise(control, parameter_grads(chunks))
    assert left == 0 and parker.parked_rows > 0

    # The engine's own calibration step (the Calibrator parks) gives the same gradients.
    chunks = make_chunks(2, LAYERS, TOKENS, HIDDEN, FFN, SEGMENTS, seed=3)
    engine = PagingEngine(PagingConfig(page_size=PAGE), stream_backend=CpuStreamBackend())
    assert run_schedule(chunks, ops, PagingContext(engine), (TOKENS, HIDDEN), seed=3) == 0
    assert_bitwise(control, parameter_grads(chunks))
    assert engine.pools is not None and engine.steps == 1


def test_live_rows_are_cloned_at_save():
    pools = make_pools()
    backend = CpuStreamBackend()
    scheduler = PagingScheduler(backend, pools)
    live = torch.tensor([3, 1])
    source = torch.arange(8 * HIDDEN, dtype=torch.float32).reshape(8, HIDDEN)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, live, [(0, 4), (4, 4)])
    live.fill_(0)  # a dispatcher overwriting its count for the next microbatch
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)
    out = scheduler.unpack(handle)
    assert torch.equal(out[:3], source[:3]) and torch.equal(out[4:5], source[4:5])
    assert handle.record.annotations == dict(chunk=0, layer=0, microbatch=0, wgrad_only=False)
    assert scheduler.finish() == 0


def test_demand_reload_when_nobody_prefetched():
    pools = make_pools()
    backend = CpuStreamBackend()
    scheduler = PagingScheduler(backend, pools)
    source = torch.randn(8, HIDDEN)
    scheduler.open_slot(1, 2, 5)
    handle = scheduler.save(source, torch.tensor(8))
    scheduler.commit()
    assert torch.equal(scheduler.unpack(handle), source)
    (reload,) = backend.entries("launch", "reload")
    assert reload.info["reason"] == "demand"
    assert scheduler.finish() == 0


def test_unreloaded_records_are_counted_at_finish():
    scheduler = PagingScheduler(CpuStreamBackend(), make_pools())
    scheduler.open_slot(0, 0, 0)
    scheduler.save(torch.randn(8, HIDDEN), torch.tensor(5))
    scheduler.commit()
    assert scheduler.finish() == 1


def test_argument_errors():
    backend = CpuStreamBackend()
    with pytest.raises(ValueError, match="parker"):
        PagingScheduler(backend)
    with pytest.raises(ValueError, match="prefetch_distance"):
        PagingScheduler(backend, make_pools(), config=PagingConfig(prefetch_distance=-1))
    with pytest.raises(ValueError, match="kernel_backend"):
        PagingScheduler(backend, make_pools(), config=PagingConfig(kernel_backend="triton"))
    scheduler = PagingScheduler(backend, make_pools())
    with pytest.raises(RuntimeError, match="open_slot"):
        scheduler.save(torch.randn(8, HIDDEN), torch.tensor(1))
    with pytest.raises(RuntimeError, match=r"commit\(\)"):
        scheduler.commit()
    scheduler.open_slot(0, 0, 0)
    with pytest.raises(RuntimeError, match=r"\(0, 0, 0\)"):  # names the open slot
        scheduler.open_slot(0, 1, 0)
    with pytest.raises(ValueError, match="contiguous"):
        scheduler.save(torch.randn(HIDDEN, 8).t(), torch.tensor(1))
    with pytest.raises(ValueError, match="prefetch|branch"):
        scheduler.prefetch(0, 0, branch="forward")
    context = paged_context(backend, make_pools())
    context.begin_step()
    with pytest.raises(RuntimeError, match="group_start"):
        context.mark(torch.randn(4, 4), torch.tensor(1))


def test_sources_under_capture_are_released_after_a_compute_wait():
    backend = CapturingBackend()
    scheduler = PagingScheduler(backend, make_pools())
    handles = []
    for layer in range(3):
        scheduler.open_slot(0, layer, 0)
        handles.append(scheduler.save(torch.randn(8, HIDDEN), torch.tensor(6)))
        scheduler.commit()
        assert handles[-1].source is not None  # its stash may still run
        if layer:
            assert handles[-2].source is None  # released at this commit ...
            (release,) = [e for e in backend.log if e.kind == "source-release"][-1:]
            assert release.stream == COMPUTE  # ... after the compute stream waited on it
    for layer in reversed(range(3)):
        scheduler.backward_slot_start(0, layer, 0)
    for h in handles:
        scheduler.unpack(h)
    assert scheduler.finish() == 0 and handles[-1].source is None


def test_schedule_parity_under_capture_rules():
    ops = op_order.dualpipev(pp=2, rank=0, microbatches=4)
    control, *_ = run(ops, 2, paged=False)
    chunks = make_chunks(2, LAYERS, TOKENS, HIDDEN, FFN, SEGMENTS, seed=3)
    context = paged_context(CapturingBackend(), make_pools())
    left = run_schedule(chunks, ops, context, (TOKENS, HIDDEN), seed=3)
    assert left == 0
    assert_bitwise(control, parameter_grads(chunks))
