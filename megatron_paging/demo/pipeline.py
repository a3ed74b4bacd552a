"""One pipeline rank of TinyMoE, run in one process through a :class:`PagingContext`.

The rank holds one :class:`StageChunk` per model chunk of its schedule; chunk ``c`` is pipeline
stage ``stage_indices(...)[c]``. The first stage embeds tokens, the last one ends in the LM head
and the cross-entropy loss (scaled by ``1 / microbatches``, as Megatron-Core does). What the
neighbour stages would send is synthetic and seeded: the activation a non-first chunk receives,
and the gradient a non-last chunk receives for its output.

:func:`run_step` follows an op list (:class:`~megatron_paging.schedule.Op`, from the real
schedule generators) with the op-list driver the simulator uses too: every TinyMoE layer is its
own autograd island wrapped in ``group_start`` / ``group_commit``, an overlapped F+B pair runs
layer by layer, the next backward's top slots are prefetched during the op before it. TinyMoE
computes weight gradients inside its backward, so ``W`` ops have nothing to run. Nothing here
imports megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_paging.demo.model import TinyMoEConfig, TinyMoELayer, init_parameters
from megatron_paging.paging import PagingContext
from megatron_paging.schedule import Op, check_ops, drive_ops

Key = tuple[int, int]  # (chunk, microbatch)


def stage_indices(schedule: str, pp: int, rank: int, chunks: int) -> list[int]:
    """Global pipeline stage of each of ``rank``'s chunks (interleaved: round robin; V: mirror)."""
    if schedule == "interleaved":
        return [c * pp + rank for c in range(chunks)]
    if schedule == "dualpipev":
        return [rank, 2 * pp - 1 - rank]
    return [rank]


class StageChunk(nn.Module):
    """``cfg.layers`` TinyMoE layers of one pipeline stage (+ embedding / head at the ends).

    Weights are seeded by ``seed`` and the stage index only, so every run builds the same stage.
    """

    def __init__(self, cfg: TinyMoEConfig, stage: int, num_stages: int, seed: int = 0):
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == num_stages - 1
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if self.first else None
        self.layers = nn.ModuleList(TinyMoELayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden) if self.last else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if self.last else None
        init_parameters(self, seed * 1000 + stage)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@dataclass
class StepInputs:
    """What reaches the rank from outside during one step."""

    tokens: dict[int, torch.Tensor]  # microbatch -> tokens (first stage)
    targets: dict[int, torch.Tensor]  # microbatch -> targets (last stage)
    activations: dict[Key, torch.Tensor]  # from the previous stage (non-first chunks)
    output_grads: dict[Key, torch.Tensor]  # from the next stage (non-last chunks)
    loss_scale: float


def make_step_inputs(
    chunks: Sequence[StageChunk],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    seed: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype,
) -> StepInputs:
    """Inputs of one step; ``batches`` holds one (tokens, targets) pair per microbatch."""
    batch, seq = batches[0][0].shape
    activations, output_grads = {}, {}
    for c, chunk in enumerate(chunks):
        for m in range(len(batches)):
            g = torch.Generator().manual_seed(
                ((seed * 7919 + step) * 257 + chunk.stage) * 4099 + m
            )
            activation = torch.randn(batch, seq, hidden, generator=g)
            # Roughly the size of a cross-entropy gradient per token.
            grad = torch.randn(batch, seq, hidden, generator=g) / (batch * seq * len(batches))
            if not chunk.first:
                activations[(c, m)] = activation.to(device, dtype)
            if not chunk.last:
                output_grads[(c, m)] = grad.to(device, dtype)
    return StepInputs(
        tokens={m: t.to(device) for m, (t, _) in enumerate(batches)},
        targets={m: t.to(device) for m, (_, t) in enumerate(batches)},
        activations=activations,
        output_grads=output_grads,
        loss_scale=1.0 / len(batches),
    )


class MarkLedger:
    """The layers' ``paging`` argument: passes marks on to the context and keeps, per layer
    forward, the bytes of the capacity buffers it marked — what an unpaged run holds for them
    until that layer's backward."""

    def __init__(self, context: PagingContext):
        self.context = context
        self.held_bytes = 0
        self._open = 0
        self._held: dict[tuple[int, int, int], int] = {}

    def mark(self, tensor, live_rows, segments=None):
        self._open += tensor.numel() * tensor.element_size()
        return self.context.mark(tensor, live_rows, segments)

    def close(self, slot: tuple[int, int, int]) -> None:
        self._held[slot], self._open = self._open, 0
        self.held_bytes += self._held[slot]

    def release(self, slot: tuple[int, int, int]) -> None:
        self.held_bytes -= self._held.pop(slot)


@dataclass
class StepRun:
    loss: torch.Tensor | None  # sum of the scaled last-stage losses; None without a last stage
    sent_grads: dict[Key, torch.Tensor]  # input gradient each non-first chunk sends upstream


def run_step(
    chunks: Sequence[StageChunk],
    ops: Sequence[Op],
    context: PagingContext,
    inputs: StepInputs,
    ledger: MarkLedger | None = None,
    on_layer: Callable[[], None] | None = None,
) -> StepRun:
    """Run one step's ops (the caller begins and finishes the step on ``context``);
    ``on_layer`` is called after every layer forward and backward."""
    check_ops(ops)
    ledger = MarkLedger(context) if ledger is None else ledger
    islands: dict[Key, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
    losses: list[torch.Tensor] = []
    sent: dict[Key, torch.Tensor] = {}

    def forward_steps(op: Op):
        chunk, key = chunks[op.chunk], (op.chunk, op.microbatch)
        x = None if chunk.first else inputs.activations[key]
        saved = islands.setdefault(key, [])
        for index, layer in enumerate(chunk.layers):
            with context.forward(*key):
                if x is None:  # the embedding joins the first layer's island
                    x_in, h = None, chunk.embed(inputs.tokens[op.microbatch])
                else:
                    x_in = h = x.detach().requires_grad_(True)
                y = context.group_commit(layer(context.group_start(h, index), ledger))
                out = y
                if chunk.last and index == len(chunk.layers) - 1:
                    out = chunk.loss(y, inputs.targets[op.microbatch]) * inputs.loss_scale
                    losses.append(out.detach())
            ledger.close((op.chunk, index, op.microbatch))
            saved.append((x_in, out))
            x = y
            if on_layer is not None:
                on_layer()
            yield

    def backward_steps(op: Op):
        chunk, key = chunks[op.chunk], (op.chunk, op.microbatch)
        saved = islands.pop(key)
        grad = None if chunk.last else inputs.output_grads[key]
        for index in reversed(range(len(saved))):
            x_in, out = saved[index]
            with context.backward(op.chunk, op.microbatch, op.defers_wgrad):
                torch.autograd.backward(out, grad)
            ledger.release((op.chunk, index, op.microbatch))
            grad = None if x_in is None else x_in.grad
            if on_layer is not None:
                on_layer()
            yield
        if grad is not None:
            sent[key] = grad

    def prefetch(op: Op) -> None:
        if op.kind == "B":
            context.prefetch(op.chunk, op.microbatch, op.defers_wgrad)

    drive_ops(
        ops,
        forward_steps,
        backward_steps,
        [len(chunk.layers) for chunk in chunks],
        lambda op: context.run_wgrad(op.chunk, op.microbatch),  # TinyMoE defers no wgrad
        prefetch,
    )
    if islands:
        raise RuntimeError(f"forwards without a backward: {sorted(islands)}")
    loss = torch.stack(losses).sum() if losses else None
    return StepRun(loss, sent)


class SpillCountingBackend:
    """A stream backend wrapper that counts the stashes the pinned-host tier took.

    It reads pool counters on the host around every stash (on CUDA after a device
    synchronize), which serializes the paging stream: demo accounting, not for benchmarks.
    """

    def __init__(self, inner):
        self.inner = inner
        self.host_spills = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, stream, kind: str, fn: Callable[[], None], **info) -> None:
        pool = info.get("pool")
        if kind != "stash" or pool is None or not pool.has_host_tier:
            return self.inner.launch(stream, kind, fn, **info)
        before = host_free_pages(pool)
        self.inner.launch(stream, kind, fn, **info)
        self.host_spills += host_free_pages(pool) < before


def host_free_pages(pool) -> int:
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)  # the paging stream may still be writing
    return pool.free_pages()[1]


__all__ = [
    "MarkLedger",
    "SpillCountingBackend",
    "StageChunk",
    "StepInputs",
    "StepRun",
    "make_step_inputs",
    "run_step",
    "stage_indices",
]
