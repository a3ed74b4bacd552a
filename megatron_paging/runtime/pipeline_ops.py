"""One pipeline rank's compute ops (F, B, W), their checks, and the driver that runs them.

An op list (from Megatron-Core's own schedule generators through
:mod:`megatron_paging.mcore.op_order`, or PyTorch's DualPipeV) says in which order a rank runs
the forward (``F``), backward (``B``) and deferred weight-gradient (``W``) of each (chunk,
microbatch). :func:`drive_ops` executes such a list over per-layer step generators, interleaving
an overlapped F/B pair layer by layer as combined 1F1B and DualPipeV do; the pipeline simulator
(:mod:`megatron_paging.tools.pipeline_sim`, which the demo runs through) drives its layers with
it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

OP_KINDS = ("F", "B", "W")


class Op(NamedTuple):
    """One compute op of a rank's schedule.

    kind: ``F`` forward, ``B`` backward, ``W`` deferred weight gradient.
    defers_wgrad: on a ``B``: its weight gradient runs in a later ``W`` op of the same
        (chunk, microbatch).
    overlap: on an ``F``: runs interleaved layer by layer with the next op (a ``B``).
    """

    kind: str
    chunk: int
    microbatch: int
    defers_wgrad: bool = False
    overlap: bool = False

    def __repr__(self) -> str:
        extra = ("/I" if self.defers_wgrad else "") + ("+" if self.overlap else "")
        return f"{self.kind}{self.chunk}.{self.microbatch}{extra}"


def check_ops(ops: Sequence[Op]) -> None:
    """Each (chunk, microbatch) runs F, then B, then W iff its B deferred; overlap pairs F+B."""
    state: dict[tuple[int, int], str] = {}
    for i, op in enumerate(ops):
        if op.kind not in OP_KINDS:
            raise ValueError(f"op {i}: kind must be one of {OP_KINDS}, got {op.kind!r}")
        key, seen = (op.chunk, op.microbatch), state.get((op.chunk, op.microbatch), "")
        expected = {"F": "", "B": "F", "W": "FI"}[op.kind]
        if seen != expected:
            raise ValueError(f"op {i} ({op!r}) comes after {seen or 'nothing'} for {key}")
        state[key] = seen + ("I" if op.kind == "B" and op.defers_wgrad else op.kind)
        if op.overlap and (op.kind != "F" or i + 1 >= len(ops) or ops[i + 1].kind != "B"):
            raise ValueError(f"op {i} ({op!r}): overlap needs an F followed by a B")
    unfinished = [k for k, v in state.items() if v not in ("FB", "FIW")]
    if unfinished:
        raise ValueError(f"(chunk, microbatch) pairs never finished: {unfinished}")


def drive_ops(
    ops: Sequence[Op],
    forward_steps: Callable[[Op], Iterator[None]],
    backward_steps: Callable[[Op], Iterator[None]],
    layers_per_chunk: Sequence[int],
    run_wgrad: Callable[[Op], None],
    prefetch: Callable[[Op], None] | None = None,
    on_op: Callable[[int, Op], None] | None = None,
) -> None:
    """Execute one rank's op list with per-layer step generators.

    ``forward_steps(op)`` / ``backward_steps(op)`` yield once per layer. An overlapped F+B pair
    (combined 1F1B, DualPipeV) advances both layer by layer, then runs each to completion so
    code after a generator's last yield still executes. Before each op, ``prefetch`` is offered
    the op(s) that run next, so their reloads can start during this one.
    """
    i = 0
    while i < len(ops):
        op = ops[i]
        if on_op is not None:
            on_op(i, op)
        span = 2 if op.overlap else 1
        if prefetch is not None:
            for upcoming in ops[i + 1 : i + 1 + span]:
                prefetch(upcoming)
        if op.overlap:
            partner = ops[i + 1]
            f_steps, b_steps = forward_steps(op), backward_steps(partner)
            for _ in range(max(layers_per_chunk[op.chunk], layers_per_chunk[partner.chunk])):
                next(f_steps, None)
                next(b_steps, None)
            for steps in (f_steps, b_steps):
                for _ in steps:
                    pass
        elif op.kind == "F":
            for _ in forward_steps(op):
                pass
        elif op.kind == "B":
            for _ in backward_steps(op):
                pass
        else:
            run_wgrad(op)
        i += span


__all__ = ["OP_KINDS", "Op", "check_ops", "drive_ops"]
