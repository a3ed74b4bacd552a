"""Shared by the offload test files: a model step through an offload group on the CPU stream
backend, and a GPU step whose outputs a CUDA graph can replay (each asserts what came back)."""

from __future__ import annotations

import pytest
import torch

from megatron_paging.config import PagingConfig
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine

PAGE = 4
HIDDEN = 8


def _context(backend, **options):
    config = PagingConfig(page_size=PAGE, kernel_backend="reference", **options)
    return PagingContext(PagingEngine(config, stream_backend=backend))


def _step(context, live_counts, whole_shapes=((6, HIDDEN),), stash=False, seed=0):
    """One step, one microbatch per live count: a layer slot (stashing one buffer when
    ``stash``) holding an offload group with one live-row buffer and whole tensors; backward in
    reverse. Returns what came back and what went in."""
    gen = torch.Generator().manual_seed(seed)
    context.begin_step()
    saved, originals = [], []
    for mb, live in enumerate(live_counts, start=1):
        context.open_slot(0, 0, mb, "cpu")
        rows = torch.randn(16, HIDDEN, generator=gen)
        stashed = context.pack_marked(rows.clone(), torch.tensor([live]), 16) if stash else None
        context.open_offload_group(0, ("offload", 0, "expert_fc1"), mb, "cpu")
        live_rows = torch.tensor([live])
        items = [context.pack_offload(rows, live_rows, 16)]
        wholes = [torch.randn(*shape, generator=gen) for shape in whole_shapes]
        items += [context.pack_offload(w) for w in wholes]
        context.commit_slot()  # the offload group first (innermost) ...
        context.commit_slot()  # ... then the layer slot
        saved.append((mb, items, stashed))
        originals.append((rows.clone(), [w.clone() for w in wholes], live))
    back = {}
    for mb, items, stashed in reversed(saved):
        context.scheduler.backward_slot_start(0, 0, mb)
        context.scheduler.backward_slot_start(0, ("offload", 0, "expert_fc1"), mb)
        back[mb] = [context.unpack(s) for s in items]
        if stashed is not None:
            back[mb].append(context.unpack(stashed))
    context.finish()
    return back, originals


def _cuda_kernels_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        from megatron_paging.kernels import cuda_ops

        cuda_ops.bulk_supported(torch.cuda.current_device())
    except Exception as error:  # noqa: BLE001 - any build/load failure: not available here
        pytest.skip(f"CUDA kernels unavailable: {error}")


class _OffloadStep:
    """One step on the GPU: an offload group with a live-row buffer and a whole tensor, its
    reload copied into static outputs (so a CUDA graph can replay it). ``act_hidden``: a second
    group (``moe_act``) offloads a live-row buffer of that width (a second pool and stream)."""

    def __init__(self, context, capacity=512, hidden=256, act_hidden=None):
        self.context = context
        gen = torch.Generator(device="cuda").manual_seed(5)
        self.rows = torch.randn(capacity, hidden, device="cuda", generator=gen)
        self.dense = torch.randn(300, hidden, device="cuda", generator=gen)
        self.act = (None if act_hidden is None
                    else torch.randn(capacity, act_hidden, device="cuda", generator=gen))
        self.live = torch.tensor([capacity // 3], dtype=torch.int64, device="cuda")
        self.rows_back = torch.zeros_like(self.rows)
        self.dense_back = torch.zeros_like(self.dense)
        self.act_back = None if self.act is None else torch.zeros_like(self.act)

    def __call__(self):
        context = self.context
        context.begin_step()
        groups = [("offload", 0, "expert_fc1")] + ([] if self.act is None else
                                                   [("offload", 1, "moe_act")])
        context.open_offload_group(0, groups[0], 1, "cuda")
        saved = [context.pack_offload(self.rows, self.live, self.rows.shape[0]),
                 context.pack_offload(self.dense)]
        context.commit_slot()
        if self.act is not None:
            context.open_offload_group(0, groups[1], 1, "cuda")
            saved.append(context.pack_offload(self.act, self.live, self.act.shape[0]))
            context.commit_slot()
        for group in reversed(groups):
            context.scheduler.backward_slot_start(0, group, 1)
        backs = [self.rows_back, self.dense_back] + ([] if self.act is None else [self.act_back])
        for back, handle in zip(backs, saved, strict=True):
            back.copy_(context.unpack(handle))
        assert context.finish() == 0

    def check(self):
        torch.cuda.synchronize()
        live = int(self.live.item())
        assert torch.equal(self.rows_back[:live], self.rows[:live])
        assert torch.equal(self.dense_back, self.dense)
        if self.act is not None:
            assert torch.equal(self.act_back[:live], self.act[:live])

    def zero_outputs(self):
        for back in (self.rows_back, self.dense_back, self.act_back):
            if back is not None:
                back.zero_()
