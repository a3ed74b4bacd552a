"""The pool-sizing Monte-Carlo: seeded, monotone in the target rate, exact where routing is
deterministic, and a recorded trace replayed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_paging.plan.pools import (
    EXACT_DRAWS,
    LoadModel,
    factor_for_rate,
    overflow_rate,
    simulate,
)
from megatron_paging.tools.peer_load import TRACE_FORMAT, LognormalLoad, RouteShape, TraceLoad

# 8 EP peers of 512 tokens top-4 over 64 experts (8 local), blocks of 1.5x the average
ROUTE = RouteShape(tokens=512, topk=4, num_experts=64, ep=8, rank=3)
MODEL = LoadModel(ROUTE, block=384, page=16, record_layers=(1, 2, 3, 1, 2, 3))


def test_simulation_is_seeded():
    load = LognormalLoad(0.5, seed=1)
    a = simulate(load, MODEL, 300, seed=7)
    assert np.array_equal(a, simulate(load, MODEL, 300, seed=7))
    assert not np.array_equal(a, simulate(load, MODEL, 300, seed=8))
    # every record holds at most its capacity (8 peers x a block), page-rounded
    assert a.max() <= 6 * 8 * 384
    # about tokens x topk rows per record on average
    assert a.mean() / (6 * 512 * 4) == pytest.approx(1.0, abs=0.05)


def test_factor_shrinks_as_the_target_rate_grows():
    samples = simulate(LognormalLoad(0.5, seed=2), MODEL, 2000, seed=2)
    hint = 6 * 512 * 4
    for measured in (False, True):
        factors = [factor_for_rate(samples, hint, rate, measured, cap=10.0)[0]
                   for rate in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)]
        assert factors == sorted(factors, reverse=True)
        assert factors[-1] > 1.0
    # the rate of a factor and the factor of a rate agree
    factor, _ = factor_for_rate(samples, hint, 1e-2, False, cap=10.0)
    assert overflow_rate(samples, hint, factor) <= 1e-2 * 1.5


def test_uniform_routing_without_peers_is_exact():
    route = RouteShape(tokens=512, topk=2, num_experts=8, ep=1, rank=0)
    samples = simulate(LognormalLoad(0.3), LoadModel(route, 1536, 64, (1, 2)), 50, seed=0)
    assert set(samples.tolist()) == {2 * 1024}  # one rank holds every expert: all routes
    factor, _ = factor_for_rate(samples, 2048, 1e-3, False, cap=1.5)
    assert factor == pytest.approx(1.0)
    assert overflow_rate(samples, 2048, 1.1) == 0.0


def test_trace_replayed(tmp_path):
    route = RouteShape(tokens=4, topk=2, num_experts=4, ep=2, rank=0)
    # layer 1, two microbatches: [peer][local expert] rows; block 3 caps peer 1 of the second
    trace = {"format": TRACE_FORMAT, "num_experts": 4, "ep": 2, "rank": 0, "tokens_per_peer": 4,
             "topk": 2, "microbatches_per_step": 2, "source": "test",
             "layers": {"1": [[[1, 1], [2, 0]], [[0, 1], [3, 2]]]}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    samples = simulate(TraceLoad(str(path)), LoadModel(route, 3, 1, (1,)), 400, seed=0)
    assert set(samples.tolist()) == {4, 1 + 3}
    with pytest.raises(ValueError, match="no layer 2"):
        simulate(TraceLoad(str(path)), LoadModel(route, 3, 1, (2,)), 10, seed=0)


def _brute_force_needs(chunks, ops, live, records, page):
    """Walk the ops one by one: a chunk-microbatch's records enter with its forward and leave
    after its backward starts; per step the most page-rounded rows held at once."""
    where = {rec: j for j, rec in enumerate(records)}
    out = []
    for step in live:
        held, most = 0, 0
        for op in ops:
            moe = [layer.number for layer in chunks[op.chunk].layers if layer.moe]
            rows = sum(-(-int(step[where[(op.chunk, op.microbatch, n)]]) // page) * page
                       for n in moe)
            if op.kind == "F":
                held += rows
                most = max(most, held)
            elif op.kind == "B":
                most = max(most, held)
                held -= rows
        out.append(most)
    return out


@pytest.mark.parametrize("ep", [4, 1024])  # exact binomial draws; their normal limit
def test_step_need_is_the_most_any_schedule_moment_holds(ep):
    from megatron_paging.plan import shapes as S
    from megatron_paging.plan.liveness import one_f_one_b_ops, record_schedule
    from megatron_paging.plan.pools import _lognormal_live, page_rows

    chunks = (S.Chunk(0, (S.Layer(1, False), S.Layer(2, True), S.Layer(3, True))),)
    ops = one_f_one_b_ops(3, 0, 6)  # 3 microbatches in flight at the peak, 6 per step
    schedule = record_schedule(chunks, ops)
    assert len(schedule.records) == 12 and schedule.peak_records == 6
    route = RouteShape(tokens=256, topk=2, num_experts=4 * ep, ep=ep, rank=1)
    block = 96 if ep == 4 else 2  # 128 and 0.5 routes per peer on average
    model = LoadModel(route, block, 16, schedule.layers, schedule.alive)
    load, steps, seed = LognormalLoad(0.5), 300, 11
    assert (steps * len(schedule.records) * ep > EXACT_DRAWS) == (ep > 4)
    needs = simulate(load, model, steps, seed)
    # the same draws (one chunk of steps), walked op by op
    live = _lognormal_live(load, model, steps, np.random.default_rng(seed))
    assert needs.tolist() == _brute_force_needs(chunks, ops, live, schedule.records, 16)
    # the moment with the most records alone falls short on some steps
    peak_only = page_rows(live, 16)[:, schedule.peak_moment].sum(axis=1)
    assert (peak_only <= needs).all() and (peak_only < needs).any()
