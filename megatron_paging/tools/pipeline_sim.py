"""Run one pipeline rank's schedule in one process, and a synthetic MoE layer stack to run.

:func:`run_schedule` takes the rank's model chunks (each a list of layers called as
``layer(x, context)``), an op list (:class:`~megatron_paging.schedule.Op`, e.g. from
:mod:`megatron_paging.mcore.schedules`) and a :class:`~megatron_paging.paging.PagingContext`, and
runs one step. Activations from the previous stage and
gradients from the next one are synthetic (seeded per chunk and microbatch). Every layer is its
own autograd island (input detached), so forward and backward of different microbatches can
interleave layer by layer, as Megatron-Core's combined 1F1B and DualPipeV's overlapped F/B do.

:class:`SyntheticMoELayer` is a small MoE-like layer: a dense part, a data-dependent router that
fills a capacity buffer with per-segment live prefixes, and two expert GEMMs that, like a grouped
GEMM, read only live rows (:class:`LiveRowsLinear`). It marks its capacity buffers for paging and
can defer its weight gradients. Nothing here imports megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_paging.paging import PagingContext
from megatron_paging.schedule import Op, check_ops, drive_ops


def _seeded(seed: int, chunk: int, microbatch: int, salt: int) -> torch.Generator:
    mixed = seed * 1_000_003 + chunk * 10_007 + microbatch * 101 + salt
    return torch.Generator().manual_seed(mixed)


def run_schedule(
    chunks: Sequence[Sequence[nn.Module]],
    ops: Sequence[Op],
    context: PagingContext,
    input_shape: tuple[int, ...],
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    prefetch_ops: bool = True,
    on_op: Callable[[int, Op], None] | None = None,
    make_input: Callable[[int, int, int], torch.Tensor] | None = None,
) -> int:
    """Run ``ops`` on ``chunks`` as one step (``context.begin_step()`` ... ``context.finish()``);
    returns the records never reloaded.

    ``make_input(chunk, microbatch, salt)`` overrides the seeded synthetic tensors (salt 1: the
    chunk's input activation, salt 2: its output gradient), e.g. to pre-generate them on a GPU.
    """
    check_ops(ops)
    context.begin_step()
    saved: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def synthetic(chunk: int, microbatch: int, salt: int) -> torch.Tensor:
        if make_input is not None:
            return make_input(chunk, microbatch, salt)
        g = _seeded(seed, chunk, microbatch, salt)
        return torch.randn(input_shape, generator=g, dtype=dtype).to(device)

    def forward_steps(op: Op):
        x = synthetic(op.chunk, op.microbatch, 1)
        layers = saved.setdefault((op.chunk, op.microbatch), [])
        for index, layer in enumerate(chunks[op.chunk]):
            x_in = x.detach().requires_grad_(True)
            with context.forward(op.chunk, op.microbatch):
                y = context.group_commit(layer(context.group_start(x_in, index), context))
            layers.append((x_in, y))
            x = y
            yield

    def backward_steps(op: Op):
        layers = saved.pop((op.chunk, op.microbatch))
        grad = synthetic(op.chunk, op.microbatch, 2)
        for x_in, y in reversed(layers):
            with context.backward(op.chunk, op.microbatch, op.defers_wgrad):
                torch.autograd.backward(y, grad)
            grad = x_in.grad
            yield

    def prefetch(op: Op) -> None:
        if op.kind == "B":
            context.prefetch(op.chunk, op.microbatch, op.defers_wgrad)
        elif op.kind == "W":
            context.prefetch_wgrad(op.chunk, op.microbatch)

    drive_ops(
        ops,
        forward_steps,
        backward_steps,
        [len(layers) for layers in chunks],
        lambda op: context.run_wgrad(op.chunk, op.microbatch),
        prefetch if prefetch_ops else None,
        on_op,
    )
    if saved:
        raise RuntimeError(f"forwards without a backward: {sorted(saved)}")
    return context.finish()


# --------------------------------------------------------------------- synthetic MoE stack
class LiveRowsLinear(torch.autograd.Function):
    """``x @ weight`` on live rows only (others give 0), like a grouped GEMM with token counts.

    ``x`` is read only by the weight gradient; it is kept with ``context.pack`` so a deferred
    wgrad unpacks it only when it runs. Gradients are masked too, so bytes outside the live rows
    (undefined after a reload) never reach a result.
    """

    @staticmethod
    def forward(ctx, x, weight, row_mask, context):
        ctx.context, ctx.x_saved = context, context.pack(x)
        # The parameter itself, not a saved-tensor alias: the deferred wgrad writes its .grad.
        ctx.weight = weight
        ctx.save_for_backward(row_mask)
        return torch.where(row_mask[:, None], x @ weight, 0)

    @staticmethod
    def backward(ctx, grad):
        (row_mask,), weight = ctx.saved_tensors, ctx.weight
        grad = torch.where(row_mask[:, None], grad, 0)
        context, x_saved = ctx.context, ctx.x_saved

        def wgrad():
            x = torch.where(row_mask[:, None], context.unpack(x_saved), 0)
            g = x.t() @ grad
            if weight.grad is None:
                weight.grad = g
            else:
                weight.grad.add_(g)

        if context.wgrad_deferred:
            context.defer_wgrad(wgrad)
        else:
            wgrad()
        return grad @ weight.t(), None, None, None


class SyntheticMoELayer(nn.Module):
    """Dense block + data-dependent routing into a capacity buffer + two live-row expert GEMMs.

    Tokens are split round-robin into ``segments`` equal segments (one per "expert"); inside a
    segment, tokens with a positive router score come first and count as live. The live counts
    live in ``self.live_rows``, overwritten in place every microbatch like a dispatcher's
    attribute: the paging scheduler must clone them.
    """

    def __init__(self, tokens: int, hidden: int, ffn: int, segments: int, seed: int = 0):
        super().__init__()
        if tokens % segments:
            raise ValueError(f"tokens={tokens} must be divisible by segments={segments}")
        g = torch.Generator().manual_seed(seed)
        self.w_dense = nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
        self.w1 = nn.Parameter(torch.randn(hidden, ffn, generator=g) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(ffn, hidden, generator=g) / ffn**0.5)
        self.register_buffer("router", torch.randn(hidden, generator=g))
        self.register_buffer("live_rows", torch.zeros(segments, dtype=torch.int64))
        self.num_segments, self.segment_rows = segments, tokens // segments
        self.segments = [(s * self.segment_rows, self.segment_rows) for s in range(segments)]
        # Static index tensors, built once: fewer small ops per forward keeps benchmarks GPU-bound.
        self.register_buffer("segment_of", torch.arange(tokens) % segments, persistent=False)
        self.register_buffer("row_in_segment", torch.arange(self.segment_rows), persistent=False)

    def forward(self, x: torch.Tensor, context: PagingContext) -> torch.Tensor:
        x = x + torch.tanh(x @ self.w_dense)
        segment_of = self.segment_of
        positive = (x.detach() @ self.router) > 0
        perm = torch.argsort(segment_of * 2 + (~positive).long(), stable=True)
        self.live_rows.zero_().index_add_(0, segment_of, positive.long())
        row_mask = (self.row_in_segment[None, :] < self.live_rows[:, None]).reshape(-1)
        buffer = x.index_select(0, perm)
        context.mark(buffer, self.live_rows, self.segments, wgrad_only=True)
        h = LiveRowsLinear.apply(buffer, self.w1, row_mask, context)
        context.mark(h, self.live_rows, self.segments)
        a = F.gelu(h)
        context.mark(a, self.live_rows, self.segments, wgrad_only=True)
        out = LiveRowsLinear.apply(a, self.w2, row_mask, context)
        return x + out.index_select(0, torch.argsort(perm))


def synthetic_chunks(
    num_chunks: int,
    layers_per_chunk: int,
    tokens: int = 32,
    hidden: int = 16,
    ffn: int = 24,
    segments: int = 2,
    seed: int = 0,
) -> list[list[SyntheticMoELayer]]:
    """``num_chunks`` lists of seeded :class:`SyntheticMoELayer` (same seed: same weights)."""
    return [
        [
            SyntheticMoELayer(tokens, hidden, ffn, segments, seed * 1000 + c * 100 + i)
            for i in range(layers_per_chunk)
        ]
        for c in range(num_chunks)
    ]


def parameter_grads(chunks: Sequence[Sequence[nn.Module]]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by ``chunk.layer.name`` (clones)."""
    return {
        f"{c}.{i}.{name}": p.grad.detach().clone()
        for c, layers in enumerate(chunks)
        for i, layer in enumerate(layers)
        for name, p in layer.named_parameters()
        if p.grad is not None
    }


__all__ = [
    "LiveRowsLinear",
    "SyntheticMoELayer",
    "parameter_grads",
    "run_schedule",
    "synthetic_chunks",
]
