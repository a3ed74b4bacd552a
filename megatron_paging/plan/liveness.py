"""Which chunk-microbatches keep activations alive, op by op, on one pipeline rank.

The op lists come from Megatron-Core's own schedule generators (the adapter calls
:mod:`megatron_paging.mcore.op_order`, which wraps ``get_pp_rank_microbatches`` and
``get_schedule_table``); :func:`one_f_one_b_ops` is the non-interleaved order written out for
callers without Megatron (tests check it against the generator). A chunk-microbatch's saved
activations live from the end of its forward (``F``) to its backward (``B``); a deferred weight
gradient (``W``) keeps no activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_paging.runtime.pipeline_ops import Op


def one_f_one_b_ops(pp: int, rank: int, microbatches: int) -> list[Op]:
    """Megatron's non-interleaved 1F1B for stage ``rank`` of ``pp``: ``min(pp - rank - 1, M)``
    warm-up forwards, then one forward and one backward per step, then the cool-down
    backwards (``pp = 1`` is Megatron's no-pipelining order, F and B alternating)."""
    if not (pp >= 1 and 0 <= rank < pp and microbatches >= 1):
        raise ValueError(f"need pp >= 1, 0 <= rank < pp, microbatches >= 1; got {pp}, {rank}, "
                         f"{microbatches}")
    warmup = min(pp - rank - 1, microbatches)
    ops = [Op("F", 0, m) for m in range(warmup)]
    for j in range(microbatches - warmup):
        ops += [Op("F", 0, warmup + j), Op("B", 0, j)]
    ops += [Op("B", 0, j) for j in range(microbatches - warmup, microbatches)]
    return ops


@dataclass(frozen=True)
class Moment:
    """One candidate peak: the end of a forward or the start of a backward of ``chunk``.

    ``alive[c]`` counts the microbatches of chunk ``c`` whose activations are kept at that
    moment, the op's own one included."""

    index: int
    kind: str  # "forward" | "backward"
    chunk: int
    microbatch: int
    alive: tuple[int, ...]

    @property
    def in_flight(self) -> int:
        return sum(self.alive)


def moments(ops: Sequence[Op], chunks: int) -> list[Moment]:
    """Every forward end and backward start of ``ops``, with the chunk-microbatches alive."""
    alive = [0] * chunks
    out = []
    for i, op in enumerate(ops):
        if op.kind == "F":
            alive[op.chunk] += 1
            out.append(Moment(i, "forward", op.chunk, op.microbatch, tuple(alive)))
        elif op.kind == "B":
            out.append(Moment(i, "backward", op.chunk, op.microbatch, tuple(alive)))
            alive[op.chunk] -= 1
    return out


def max_in_flight(ops: Sequence[Op], chunks: int) -> int:
    """The most chunk-microbatches whose activations are alive at once."""
    return max((m.in_flight for m in moments(ops, chunks)), default=0)


@dataclass(frozen=True)
class RecordSchedule:
    """One rank's pool records (``(chunk, microbatch, layer number)``: one per MoE layer of a
    chunk-microbatch) and which are in flight at each distinct schedule moment (forward end,
    backward start): ``alive[k, r]``, a 0/1 moment x record incidence."""

    records: tuple[tuple[int, int, int], ...]
    alive: np.ndarray  # bool [moments, records]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(layer for _, _, layer in self.records)

    @property
    def peak_records(self) -> int:
        return int(self.alive.sum(axis=1).max()) if self.alive.size else 0

    @property
    def peak_moment(self) -> np.ndarray:
        """The incidence row of the moment with the most records in flight (the first such)."""
        return self.alive[int(np.argmax(self.alive.sum(axis=1)))]


def record_schedule(chunks, ops: Sequence[Op]) -> RecordSchedule:
    """The rank's records and their lifetimes from its op order: a chunk-microbatch's records
    enter the pool with its forward and leave at its backward (as :func:`moments` counts)."""
    moe = [[layer.number for layer in chunk.layers if layer.moe] for chunk in chunks]
    records, index = [], {}
    for op in ops:
        if op.kind == "F" and (op.chunk, op.microbatch) not in index:
            index[(op.chunk, op.microbatch)] = [len(records) + i for i in range(len(moe[op.chunk]))]
            records += [(op.chunk, op.microbatch, n) for n in moe[op.chunk]]
    alive, rows = np.zeros(len(records), dtype=bool), []
    for op in ops:
        if op.kind == "F":
            alive[index[(op.chunk, op.microbatch)]] = True
            rows.append(alive.copy())
        elif op.kind == "B":
            rows.append(alive.copy())
            alive[index[(op.chunk, op.microbatch)]] = False
    if not records or not rows:
        return RecordSchedule(tuple(records), np.zeros((0, len(records)), dtype=bool))
    return RecordSchedule(tuple(records), np.unique(np.array(rows, dtype=bool), axis=0))


__all__ = ["Moment", "RecordSchedule", "max_in_flight", "moments", "one_f_one_b_ops",
           "record_schedule"]
