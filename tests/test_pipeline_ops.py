"""One rank's compute ops (runtime/pipeline_ops.py): check_ops' errors, drive_ops' execution
order (overlapped F+B pairs, prefetch offers, W ops), and the real generators' orders passing the
checks."""

from __future__ import annotations

import functools
import warnings

import pytest
from cases import SCHEDULE_CASES

from megatron_paging.runtime.pipeline_ops import OP_KINDS, Op, check_ops, drive_ops

pytest.importorskip("megatron.core", reason="Megatron-Core's schedule orders need megatron-core")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron_paging.mcore import op_order

F, B, W = (functools.partial(Op, kind) for kind in OP_KINDS)


def test_op_repr_and_kinds():
    assert OP_KINDS == ("F", "B", "W")
    assert [repr(op) for op in (F(0, 1, overlap=True), B(1, 2, defers_wgrad=True), W(1, 2))] == [
        "F0.1+", "B1.2/I", "W1.2"
    ]


VALID = [
    [F(0, 0), B(0, 0)],
    [F(0, 0), F(0, 1), B(0, 0), B(0, 1)],
    [F(0, 0), B(0, 0, defers_wgrad=True), W(0, 0)],
    [F(0, 0), F(1, 0, overlap=True), B(0, 0), B(1, 0)],
    [],
]


@pytest.mark.parametrize("ops", VALID, ids=lambda ops: " ".join(map(repr, ops)) or "empty")
def test_check_ops_accepts_complete_orders(ops):
    check_ops(ops)


ERRORS = [
    ([Op("X", 0, 0)], r"op 0: kind must be one of \('F', 'B', 'W'\), got 'X'"),
    ([B(0, 0)], r"op 0 \(B0.0\) comes after nothing for \(0, 0\)"),
    ([F(0, 0), F(0, 0)], r"op 1 \(F0.0\) comes after F for \(0, 0\)"),
    ([F(0, 0), B(0, 0), W(0, 0)], r"op 2 \(W0.0\) comes after FB for \(0, 0\)"),
    ([F(0, 0), W(0, 0)], r"op 1 \(W0.0\) comes after F for \(0, 0\)"),
    ([F(0, 0), B(0, 0), B(0, 0)], r"op 2 \(B0.0\) comes after FB"),
    ([F(0, 0), B(0, 0, overlap=True)], r"op 1 \(B0.0\+\): overlap needs an F followed by a B"),
    ([F(0, 0, overlap=True), F(0, 1), B(0, 0), B(0, 1)], "overlap needs an F followed by a B"),
    ([F(0, 0), F(0, 1, overlap=True)], r"op 1 \(F0.1\+\): overlap needs"),
    ([F(0, 0)], r"never finished: \[\(0, 0\)\]"),
    ([F(0, 0), B(0, 0, defers_wgrad=True)], r"never finished: \[\(0, 0\)\]"),
    ([F(1, 2), F(0, 0), B(0, 0)], r"never finished: \[\(1, 2\)\]"),
]


@pytest.mark.parametrize(("ops", "match"), ERRORS, ids=[m for _, m in ERRORS])
def test_check_ops_errors(ops, match):
    with pytest.raises(ValueError, match=match) as error:
        check_ops(ops)
    assert "\n" not in str(error.value)


class Recorder:
    """Per-layer step generators and callbacks that log what drive_ops runs, in order."""

    def __init__(self, layers_per_chunk):
        self.layers, self.log = layers_per_chunk, []

    def forward_steps(self, op):
        for layer in range(self.layers[op.chunk]):
            self.log.append(f"{op!r} L{layer}")
            yield
        self.log.append(f"{op!r} end")  # after the last yield: must still run

    def backward_steps(self, op):
        for layer in reversed(range(self.layers[op.chunk])):
            self.log.append(f"{op!r} L{layer}")
            yield
        self.log.append(f"{op!r} end")

    def drive(self, ops, prefetch=True):
        check_ops(ops)
        drive_ops(
            ops, self.forward_steps, self.backward_steps, self.layers,
            lambda op: self.log.append(f"{op!r} run"),
            (lambda op: self.log.append(f"prefetch {op!r}")) if prefetch else None,
            lambda i, op: self.log.append(f"op {i}"),
        )
        return self.log


def test_drive_ops_runs_ops_in_order_with_prefetch_offers():
    ops = [F(0, 0), B(0, 0, defers_wgrad=True), W(0, 0)]
    assert Recorder([2]).drive(ops) == [
        "op 0", "prefetch B0.0/I", "F0.0 L0", "F0.0 L1", "F0.0 end",
        "op 1", "prefetch W0.0", "B0.0/I L1", "B0.0/I L0", "B0.0/I end",
        "op 2", "W0.0 run",
    ]
    assert Recorder([2]).drive(ops, prefetch=False) == [
        "op 0", "F0.0 L0", "F0.0 L1", "F0.0 end", "op 1", "B0.0/I L1", "B0.0/I L0",
        "B0.0/I end", "op 2", "W0.0 run",
    ]


def test_drive_ops_interleaves_an_overlapped_pair_layer_by_layer():
    ops = [F(0, 0), F(0, 1, overlap=True), B(0, 0), B(0, 1)]
    assert Recorder([2]).drive(ops) == [
        "op 0", "prefetch F0.1+", "F0.0 L0", "F0.0 L1", "F0.0 end",
        # the pair: both of its ops are offered for prefetch (the B and the op after it)
        "op 1", "prefetch B0.0", "prefetch B0.1",
        "F0.1+ L0", "B0.0 L1", "F0.1+ L1", "B0.0 L0", "F0.1+ end", "B0.0 end",
        "op 3", "B0.1 L1", "B0.1 L0", "B0.1 end",
    ]


def test_drive_ops_pairs_chunks_of_different_depths():
    # Chunk 1 has 3 layers, chunk 0 one: the shorter backward finishes (its code after the
    # last yield runs) while the forward goes on.
    ops = [F(0, 0), F(1, 0, overlap=True), B(0, 0), B(1, 0)]
    log = Recorder([1, 3]).drive(ops, prefetch=False)
    assert log[log.index("op 1"):log.index("op 3")] == [
        "op 1", "F1.0+ L0", "B0.0 L0", "F1.0+ L1", "B0.0 end", "F1.0+ L2", "F1.0+ end",
    ]
    # The other way round: the forward ends while the 3-layer backward goes on.
    reverse = [F(0, 0), F(1, 0), F(0, 1, overlap=True), B(1, 0), B(0, 0), B(0, 1)]
    log = Recorder([1, 3]).drive(reverse, prefetch=False)
    assert log[log.index("op 2"):log.index("op 4")] == [
        "op 2", "F0.1+ L0", "B1.0 L2", "F0.1+ end", "B1.0 L1", "B1.0 L0", "B1.0 end",
    ]


def build(schedule, options):
    if schedule == "1f1b":
        return op_order.one_f_one_b(**options), 1
    if schedule == "interleaved":
        return op_order.interleaved_one_f_one_b(**options), options["vpp"]
    return op_order.dualpipev(**options), 2


def test_schedule_orders_are_complete_and_checked():
    for schedule, options in SCHEDULE_CASES:
        ops, num_chunks = build(schedule, options)
        check_ops(ops)
        microbatches = options["microbatches"]
        forwards = sorted((op.chunk, op.microbatch) for op in ops if op.kind == "F")
        assert forwards == [(c, m) for c in range(num_chunks) for m in range(microbatches)]
        recorder = Recorder([2] * num_chunks)
        log = recorder.drive(ops)
        assert sum(line.endswith(" end") for line in log) == 2 * microbatches * num_chunks
    assert any(op.overlap for op in op_order.dualpipev(2, 0, 4))
    assert any(op.kind == "W" for op in op_order.dualpipev(2, 1, 5))
    with pytest.raises(ValueError, match="group_size"):
        op_order.interleaved_one_f_one_b(pp=4, vpp=2, rank=0, microbatches=8, group_size=3)
    with pytest.raises(ValueError, match="DualPipeV"):
        op_order.dualpipev(pp=3, rank=0, microbatches=5)
    with pytest.raises(ValueError, match="comes after"):
        check_ops([Op("B", 0, 0)])
    with pytest.raises(ValueError, match="never finished"):
        check_ops([Op("F", 0, 0)])
