"""Run one pipeline rank's schedule in one process, and a synthetic MoE layer stack to run.

:func:`run_step` runs one step of the rank: its model chunks (each a list of layers called as
``layer(x, paging)``), an op list (:class:`~megatron_paging.runtime.pipeline_ops.Op`, e.g. from
:mod:`megatron_paging.mcore.op_order`) and a
:class:`~megatron_paging.runtime.context.PagingContext`.
Every layer is its own autograd island (input detached), so forward and backward of different
microbatches can interleave layer by layer, as Megatron-Core's combined 1F1B and DualPipeV's
overlapped F/B do. What the rest of the pipeline exchanges with the rank comes from its
:class:`Neighbours`: :class:`SyntheticNeighbours` sends seeded activations and gradients (what
:func:`run_schedule` uses); the demo's first and last stages embed tokens and end in a loss.

:class:`SyntheticMoELayer` is a small MoE-like layer: a dense part, a data-dependent router that
fills a capacity buffer with per-segment live prefixes, and two expert GEMMs that, like a grouped
GEMM, read only live rows (:class:`LiveRowsLinear`). It marks its capacity buffers for paging and
can defer its weight gradients. Nothing here imports megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.pipeline_ops import Op, check_ops, drive_ops

Key = tuple[int, int]  # (chunk, microbatch)
# The ``salt`` of ``make_input(chunk, microbatch, salt)``: what the synthetic tensor stands for.
ACTIVATION, OUTPUT_GRAD = 1, 2


class Neighbours(Protocol):
    """The rest of the pipeline as one rank sees it, per (chunk, microbatch)."""

    def forward_input(self, chunk: int, microbatch: int) -> torch.Tensor:
        """The input of the chunk's first layer. A tensor without autograd history is an
        activation from the previous stage: the layer gets a detached copy that requires grad,
        and its gradient goes back through :meth:`send_grad`. A tensor with history (a first
        stage's embedding of its tokens) is part of the first layer's island."""

    def loss(self, chunk: int, microbatch: int, output: torch.Tensor) -> torch.Tensor | None:
        """The last stage's loss of the chunk's ``output``, where its backward starts; None on
        other stages."""

    def output_grad(self, chunk: int, microbatch: int) -> torch.Tensor:
        """The gradient of the chunk's output, from the next stage (when there is no loss)."""

    def send_grad(self, chunk: int, microbatch: int, grad: torch.Tensor) -> None:
        """The gradient of the chunk's input activation, for the previous stage."""


def _seeded(seed: int, chunk: int, microbatch: int, salt: int) -> torch.Generator:
    mixed = seed * 1_000_003 + chunk * 10_007 + microbatch * 101 + salt
    return torch.Generator().manual_seed(mixed)


@dataclass
class SyntheticNeighbours:
    """Seeded stand-ins for the stages around the rank: the activation every chunk receives
    and the gradient of its output (``grad_scale`` x a standard normal); no loss, sent
    gradients are dropped. ``make_input(chunk, microbatch, salt)`` overrides the tensors (salt
    ACTIVATION or OUTPUT_GRAD), e.g. to pre-generate them on a GPU."""

    shape: tuple[int, ...]
    seed: int = 0
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    make_input: Callable[[int, int, int], torch.Tensor] | None = None
    grad_scale: float = 1.0

    def _tensor(self, chunk: int, microbatch: int, salt: int) -> torch.Tensor:
        if self.make_input is not None:
            return self.make_input(chunk, microbatch, salt)
        g = _seeded(self.seed, chunk, microbatch, salt)
        return torch.randn(self.shape, generator=g, dtype=self.dtype).to(self.device)

    def forward_input(self, chunk: int, microbatch: int) -> torch.Tensor:
        return self._tensor(chunk, microbatch, ACTIVATION)

    def loss(self, chunk: int, microbatch: int, output: torch.Tensor) -> None:
        return None

    def output_grad(self, chunk: int, microbatch: int) -> torch.Tensor:
        grad = self._tensor(chunk, microbatch, OUTPUT_GRAD)
        return grad if self.grad_scale == 1 else grad * self.grad_scale

    def send_grad(self, chunk: int, microbatch: int, grad: torch.Tensor) -> None:
        pass


@dataclass(frozen=True)
class LayerEvent:
    """A layer's forward (``kind`` "F") or backward ("B") just finished."""

    kind: str
    chunk: int
    layer: int
    microbatch: int


@dataclass
class _Island:
    """One layer's autograd island: its detached input (None when the input belongs to the
    island, like a first stage's embedding) and the tensor its backward starts from."""

    input: torch.Tensor | None
    root: torch.Tensor


@dataclass
class _Forward:
    """A (chunk, microbatch) forward, kept for its backward."""

    islands: list[_Island] = field(default_factory=list)
    ends_in_loss: bool = False


def run_step(
    chunks: Sequence[Sequence[nn.Module]],
    ops: Sequence[Op],
    context: PagingContext,
    neighbours: Neighbours,
    *,
    paging: bool = True,
    layer_paging=None,
    on_layer: Callable[[LayerEvent], None] | None = None,
    prefetch_ops: bool = True,
    on_op: Callable[[int, Op], None] | None = None,
) -> int:
    """Run ``ops`` on ``chunks`` as one step, between ``context.begin_step(paging)`` and
    ``context.finish()``; returns the records never reloaded.

    ``layer_paging`` is what the layers get as their ``paging`` argument (default: the context;
    the demo passes a wrapper that counts the bytes marked). ``on_layer`` is called after every
    layer forward and backward, ``on_op(index, op)`` before every op.
    """
    check_ops(ops)
    context.begin_step(paging)
    marks = context if layer_paging is None else layer_paging
    forwards: dict[Key, _Forward] = {}

    def forward_steps(op: Op):
        key, layers = (op.chunk, op.microbatch), chunks[op.chunk]
        kept = forwards.setdefault(key, _Forward())
        x = None
        for index, layer in enumerate(layers):
            with context.forward(*key):
                if index == 0:
                    x = neighbours.forward_input(*key)
                own = index == 0 and x.requires_grad
                x_in = None if own else x.detach().requires_grad_(True)
                h = x if own else x_in
                y = context.group_commit(layer(context.group_start(h, index), marks))
                root = y
                if index == len(layers) - 1:
                    loss = neighbours.loss(op.chunk, op.microbatch, y)
                    if loss is not None:
                        root, kept.ends_in_loss = loss, True
            kept.islands.append(_Island(x_in, root))
            x = y
            if on_layer is not None:
                on_layer(LayerEvent("F", op.chunk, index, op.microbatch))
            yield

    def backward_steps(op: Op):
        key = (op.chunk, op.microbatch)
        kept = forwards.pop(key)
        grad = None if kept.ends_in_loss else neighbours.output_grad(*key)
        for index in reversed(range(len(kept.islands))):
            island = kept.islands[index]
            with context.backward(op.chunk, op.microbatch, op.defers_wgrad):
                torch.autograd.backward(island.root, grad)
            grad = None if island.input is None else island.input.grad
            if on_layer is not None:
                on_layer(LayerEvent("B", op.chunk, index, op.microbatch))
            yield
        if grad is not None:
            neighbours.send_grad(op.chunk, op.microbatch, grad)

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
    if forwards:
        raise RuntimeError(f"forwards without a backward: {sorted(forwards)}")
    return context.finish()


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
    """One paged step of ``chunks`` between :class:`SyntheticNeighbours` of ``input_shape``
    (see :func:`run_step`); returns the records never reloaded.

    ``make_input(chunk, microbatch, salt)`` overrides the seeded synthetic tensors (salt 1: the
    chunk's input activation, salt 2: its output gradient), e.g. to pre-generate them on a GPU.
    """
    neighbours = SyntheticNeighbours(input_shape, seed, device, dtype, make_input)
    return run_step(chunks, ops, context, neighbours, prefetch_ops=prefetch_ops, on_op=on_op)


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
    "ACTIVATION",
    "OUTPUT_GRAD",
    "Key",
    "LayerEvent",
    "LiveRowsLinear",
    "Neighbours",
    "SyntheticMoELayer",
    "SyntheticNeighbours",
    "parameter_grads",
    "run_schedule",
    "run_step",
    "synthetic_chunks",
]
