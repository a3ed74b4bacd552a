"""SourceLifetimes: when a stash or offload source may be dropped. Eagerly by polling the copy's
event; inside a CUDA-graph capture (simulated: the CPU backend claims to capture and refuses
event queries) only after the compute stream waited on the copy — stashes at the next commit,
offloads once more than ``offload_in_flight`` groups of their module name are in flight, and
whatever a forward left when its backward begins; and the bound on layers whose sources are
allocated at once (``stash_in_flight``), kept when each layer's slot opens by compute-stream
waits, never host waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from capture import CapturingBackend

from megatron_paging.runtime.sources import SourceLifetimes
from megatron_paging.runtime.streams import COMPUTE, CpuStreamBackend


def group(name=None, chunk=0, microbatch=0):
    """One committed group's handle (offload groups carry their slot key, as the scheduler's)."""
    layer = 0 if name is None else ("offload", 0, name)
    return [SimpleNamespace(source=torch.zeros(1), offload=None if name is None else "whole",
                            notes={"chunk": chunk, "layer": layer, "microbatch": microbatch})]


def commit(sources, backend, handles):
    done = backend.record("paging", "stash-done")
    sources.track([(done, handles)])
    sources.release_captured(COMPUTE, [done])
    return done


def waited_on(backend):
    return [e.event for e in backend.log if e.op == "wait" and e.kind == "source-release"]


def test_eagerly_sources_go_when_their_copy_is_done():
    backend = CpuStreamBackend()  # its events are always done
    sources = SourceLifetimes(backend)
    handles = group()
    sources.track([(backend.record("paging"), handles)])
    sources.poll()
    assert handles[0].source is None and len(sources) == 0
    assert waited_on(backend) == []  # no stream waits eagerly


def test_under_capture_a_stash_source_goes_at_the_next_commit_after_a_compute_wait():
    backend = CapturingBackend()
    sources = SourceLifetimes(backend)
    first, second = group(), group()
    done = commit(sources, backend, first)
    sources.poll()  # never queries inside a capture
    assert first[0].source is not None and waited_on(backend) == []
    commit(sources, backend, second)
    assert first[0].source is None and waited_on(backend) == [done.id]
    assert second[0].source is not None


@pytest.mark.parametrize("in_flight", [0, 1, 2, 3])
def test_under_capture_offloads_stay_in_flight_per_module_name(in_flight):
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=in_flight)
    qkv, norm = [], []
    for _ in range(5):  # two module names interleaved, as a layer's groups are
        qkv.append(group("qkv_linear"))
        commit(sources, backend, qkv[-1])
        norm.append(group("mlp_norm"))
        commit(sources, backend, norm[-1])
        for handles in (qkv, norm):
            alive = [h[0].source is not None for h in handles]
            # the newest in_flight groups of each name are in flight, the older ones waited on
            assert alive == [False] * max(len(handles) - in_flight, 0) + [True] * min(
                in_flight, len(handles))
    assert len(waited_on(backend)) == 2 * max(5 - in_flight, 0)


def test_a_backward_releases_what_its_own_forward_left_only():
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=2)
    mine = [group("core_attn", microbatch=0), group("core_attn", microbatch=0)]
    other = [group("core_attn", microbatch=1)]  # a later forward (1F1B) between backward slots
    for handles in mine + other:
        commit(sources, backend, handles)
    assert all(h[0].source is not None for h in mine[1:] + other)
    sources.release_forward_of(COMPUTE, chunk=0, microbatch=0)
    assert all(h[0].source is None for h in mine)
    assert other[0][0].source is not None and len(sources) == 1
    sources.clear()
    assert other[0][0].source is None and len(sources) == 0


def test_a_closed_window_releases_that_names_sources_of_that_forward_only():
    """A forward passing a group of a name it keeps on the device (its last layer's) lets go of
    its in-flight offload sources of that name, not other names', microbatches' or stashes'."""
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=3)  # no commit releases any here
    attn = [group("core_attn"), group("core_attn")]
    norm = [group("mlp_norm")]
    later = [group("core_attn", microbatch=1)]
    for handles in attn + norm + later:
        commit(sources, backend, handles)
    assert waited_on(backend) == []
    sources.release_forward_of(COMPUTE, chunk=0, microbatch=0, name="core_attn")
    assert all(h[0].source is None for h in attn)
    assert norm[0][0].source is not None and later[0][0].source is not None
    assert len(waited_on(backend)) == 2 and len(sources) == 2


def test_forced_releases_are_freed_with_their_source_after_the_compute_wait():
    """Megatron's ``forced_released_tensors`` under capture: the storage goes (resized to 0)
    when the source sharing it is dropped after the compute stream's wait, not at the commit;
    one no queued copy reads (no tracked source shares it) goes at once."""
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=1)
    source = torch.arange(64.0)
    view = source.view(8, 8)  # what Megatron holds: the same storage
    stranger = torch.zeros(4)
    handles = group("core_attn")
    handles[0].source = source
    commit(sources, backend, handles)
    sources.free_with_sources([view, stranger])
    assert stranger.untyped_storage().size() == 0
    assert view.untyped_storage().size() > 0  # the copy may still read it
    commit(sources, backend, group("core_attn"))  # past the cap: waited on, then freed
    assert handles[0].source is None and waited_on(backend)
    assert view.untyped_storage().size() == 0


def test_a_forced_release_waits_for_every_copy_that_reads_its_storage():
    """The same storage read by two queued copies (a tensor two groups saved): releasing the
    newer group first must not free it while the older copy is still in flight."""
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=3)
    storage = torch.arange(64.0)
    older, newer = group("core_attn"), group("attn_proj")
    older[0].source, newer[0].source = storage, storage.view(8, 8)
    commit(sources, backend, older)
    commit(sources, backend, newer)
    forced = storage.view(64)
    sources.free_with_sources([forced])  # goes with the newest sharing source
    sources.release_forward_of(COMPUTE, chunk=0, microbatch=0, name="attn_proj")
    size = forced.untyped_storage().size()  # (a freed tensor cannot be printed)
    assert newer[0].source is None and size > 0  # the older copy still reads it
    sources.release_forward_of(COMPUTE, chunk=0, microbatch=0, name="core_attn")
    size = forced.untyped_storage().size()
    assert older[0].source is None and size == 0


class LaggingBackend(CpuStreamBackend):
    """A GPU that lags the host: no event is done until a test moves ``completed`` (the newest
    event id the "GPU" has reached). The backends have no host wait: nothing may block the host
    on a copy."""

    def __init__(self):
        super().__init__()
        self.completed = -1

    def done(self, event):
        return event.id <= self.completed


def open_and_commit(sources, backend, handles):
    """One paged layer: its slot opens (the bound applies), then it commits."""
    sources.layer_opens(COMPUTE)
    return commit(sources, backend, handles)


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_when_a_layer_opens_older_layers_sources_go_after_a_compute_wait(in_flight):
    """A host ahead of the GPU (no copy ever seen done): when a layer's slot opens only the
    newest ``in_flight - 1`` committed layers keep their sources, the older ones go after the
    compute stream waited on their copies (the backends have no host wait)."""
    backend = LaggingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=in_flight)
    groups, events = [], []
    for _ in range(6):
        groups.append(group())
        sources.layer_opens(COMPUTE)
        alive = [h[0].source is not None for h in groups[:-1]]
        kept = min(in_flight - 1, len(alive))
        assert alive == [False] * (len(alive) - kept) + [True] * kept
        events.append(commit(sources, backend, groups[-1]))
        assert len(sources) == kept + 1  # this layer's sources make the bound
    # one compute wait per released layer, oldest first
    assert waited_on(backend) == [e.id for e in events[: 6 - in_flight]]


def test_when_a_layer_opens_what_the_host_saw_end_goes_without_a_wait():
    backend = LaggingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=1)
    first, second, third = group(), group(), group()
    first_done = open_and_commit(sources, backend, first)
    second_done = open_and_commit(sources, backend, second)  # first: waited on
    backend.completed = second_done.id  # the GPU caught up
    open_and_commit(sources, backend, third)
    assert waited_on(backend) == [first_done.id]  # second was seen done: no wait
    assert first[0].source is None and second[0].source is None
    assert third[0].source is not None


def test_a_layer_opening_leaves_offload_groups_to_their_own_rules():
    backend = LaggingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=1)
    offloaded, stashed = group("expert_fc1"), group()
    commit(sources, backend, offloaded)
    stash_done = commit(sources, backend, stashed)
    sources.layer_opens(COMPUTE)
    assert waited_on(backend) == [stash_done.id]
    assert offloaded[0].source is not None and stashed[0].source is None


def test_eagerly_a_backward_drops_every_stash_source_after_a_compute_wait():
    """A host ahead of the GPU begins a backward before the last stashes are seen done: their
    sources go then (the compute stream waits on the copies; the host does not), not at some
    later poll — else they sit beside the reloads at the backward's peak. That holds for a later
    forward's stashes too (1F1B: the forward just before this backward left its last layer's);
    that forward's offloads (PCIe, milliseconds) keep their own rules."""
    backend = LaggingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=4)  # no layer opens in between
    seen = group()
    seen_done = commit(sources, backend, seen)
    mine = [group(), group(), group("core_attn")]
    mine_done = [commit(sources, backend, handles) for handles in mine]
    later = group(microbatch=1)  # the forward just before this backward (1F1B)
    later_done = commit(sources, backend, later)
    later_offload = group("core_attn", microbatch=1)
    commit(sources, backend, later_offload)
    backend.completed = seen_done.id  # the GPU got through the first copy only
    sources.backward_begins(chunk=0, microbatch=0)
    assert all(h[0].source is None for h in [seen, *mine, later])
    # the seen one needed no wait
    assert waited_on(backend) == [*(e.id for e in mine_done), later_done.id]
    assert later_offload[0].source is not None and len(sources) == 1
    sources.backward_begins(chunk=0, microbatch=0)  # the next slot of that backward: nothing
    assert len(waited_on(backend)) == 4 and len(sources) == 1


def test_eagerly_without_a_bound_nothing_waits():
    backend = LaggingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=0)
    groups = [group() for _ in range(6)]
    for handles in groups:
        open_and_commit(sources, backend, handles)
    assert waited_on(backend) == [] and len(sources) == 6
    assert all(h[0].source is not None for h in groups)


def test_under_capture_the_bound_waits_on_the_compute_stream():
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, stash_in_flight=1)
    events = [open_and_commit(sources, backend, group()) for _ in range(3)]
    assert waited_on(backend) == [e.id for e in events[:2]]


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_the_engine_keeps_the_bound_and_the_gradients_stay_the_controls(in_flight):
    """A whole paged run on the lagging backend (real 1F1B order, synthetic layers)."""
    from megatron_paging.config import PagingConfig
    from megatron_paging.runtime.context import PagingContext
    from megatron_paging.runtime.engine import PAGED, PagingEngine
    from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks
    from tests.test_scheduler_hold import LAYERS, PAGE, SHAPE, schedule

    num_chunks, ops = schedule("1f1b")
    control = synthetic_chunks(num_chunks, LAYERS, seed=5)
    run_schedule(control, ops, PagingContext(None), SHAPE, seed=5)
    chunks = synthetic_chunks(num_chunks, LAYERS, seed=5)
    backend = LaggingBackend()
    engine = PagingEngine(PagingConfig(page_size=PAGE, kernel_backend="reference",
                                       stash_in_flight=in_flight), stream_backend=backend)
    for _ in range(3):  # calibration, then paged steps
        for p in (p for layers in chunks for layer in layers for p in layer.parameters()):
            p.grad = None
        start = len(backend.log)
        assert run_schedule(chunks, ops, PagingContext(engine), SHAPE, seed=5) == 0
    assert engine.mode == PAGED
    log = backend.log[start:]
    groups = [e for e in log if e.op == "record" and e.kind == "stash-done"]
    released = [e for e in log if e.op == "wait" and e.kind == "source-release"]
    # nothing completes by itself on this backend: every stash group's sources go after a
    # compute-stream wait, when a later layer's slot opens (the bound) or when its forward's
    # backward begins (no source outlives that)
    assert groups
    assert sorted(e.event for e in released) == sorted(e.event for e in groups)
    alive, most = 0, 0  # layers whose sources are allocated, along the log
    for e in log:
        alive += (e.op == "record" and e.kind == "stash-done") - (e in released)
        most = max(most, alive)
    if in_flight:
        assert most == in_flight
    else:  # without the bound a forward's layers pile up until its backward begins
        assert most > 2
    expected, got = parameter_grads(control), parameter_grads(chunks)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_the_previous_layers_sources_go_when_the_next_layer_opens_before_its_records():
    """Records are made at the commit (``PagingContext.commit_slot`` saves the marked tensors
    then), so the bound must act when the next layer's slot opens: there the previous layer's
    capacity-sized sources go, before the next layer allocates its own buffers beside them."""
    from megatron_paging.config import PagingConfig
    from megatron_paging.pages.pool import PagePools
    from megatron_paging.runtime.scheduler import PagingScheduler

    backend = LaggingBackend()
    pools = PagePools(4)
    pools.add(16 * 4, cuda_rows=256)
    scheduler = PagingScheduler(backend, pools, config=PagingConfig(
        page_size=4, kernel_backend="reference", prefetch_distance=2))
    live = torch.tensor(24)
    scheduler.open_slot(0, 0, 0)
    first = scheduler.save(torch.randn(32, 16), live)
    scheduler.commit()
    assert first.source is not None  # its copy is not seen done on this backend
    scheduler.open_slot(0, 1, 0)  # nothing saved in this slot yet
    assert first.source is None
    assert [e.event for e in backend.log if e.op == "wait" and e.kind == "source-release"]
    second = scheduler.save(torch.randn(32, 16), live)
    scheduler.commit()
    assert second.source is not None and len(scheduler.sources) == 1
