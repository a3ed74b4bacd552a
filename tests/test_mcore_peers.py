"""Emulated peers (``--fake-process-group``): the peer-load models and traces, the keys that make
every exchange deterministic, the in-place fills, and one emulated EP rank of a real MoELayer
(fake process group, CPU) paged and unpaged bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_paging.tools import peer_load
from megatron_paging.tools.peer_load import (
    LognormalLoad,
    RouteShape,
    TraceRecorder,
    cap_block,
    parse_load,
)

SHAPE = RouteShape(tokens=512, topk=8, num_experts=64, ep=16, rank=5)
WORKER = Path(__file__).resolve().parent / "fake_pg_worker.py"


# -- peer-load models ------------------------------------------------------------------------


def test_lognormal_rows_depend_on_the_key_not_on_call_order():
    load = LognormalLoad(0.5, seed=3)
    first = load.rows(SHAPE, step=1, layer=4, microbatch=2, peer=7)
    load.rows(SHAPE, step=0, layer=1, microbatch=0, peer=0)  # other calls in between
    assert np.array_equal(load.rows(SHAPE, 1, 4, 2, 7), first)
    assert first.shape == (SHAPE.local_experts,) and first.dtype.kind == "i"
    others = [load.rows(SHAPE, 1, 4, 2, 8), load.rows(SHAPE, 1, 4, 3, 7),
              load.rows(SHAPE, 1, 5, 2, 7), load.rows(SHAPE, 2, 4, 2, 7),
              LognormalLoad(0.5, seed=4).rows(SHAPE, 1, 4, 2, 7)]
    assert all(not np.array_equal(other, first) for other in others)


def test_skew_moves_load_between_experts_and_zero_is_uniform():
    def max_over_mean(skew):
        totals = np.zeros(SHAPE.num_experts)
        load = LognormalLoad(skew)
        for rank in range(SHAPE.ep):  # the whole layer: every rank's local experts
            shape = RouteShape(SHAPE.tokens, SHAPE.topk, SHAPE.num_experts, SHAPE.ep, rank)
            first = rank * shape.local_experts
            for peer in range(SHAPE.ep):
                totals[first:first + shape.local_experts] += load.rows(shape, 0, 1, 0, peer)
        assert totals.sum() == SHAPE.ep * SHAPE.tokens * SHAPE.topk  # every route lands
        return totals.max() / totals.mean()

    uniform, skewed = max_over_mean(0.0), max_over_mean(1.0)
    assert uniform < 1.2 < 2.0 < skewed


def test_the_block_cap_drops_the_last_local_experts_first():
    assert cap_block(np.array([3, 4, 5]), 20).tolist() == [3, 4, 5]
    assert cap_block(np.array([3, 4, 5]), 9).tolist() == [3, 4, 2]
    assert cap_block(np.array([3, 4, 5]), 2).tolist() == [2, 0, 0]


@pytest.mark.parametrize("spec, words", [
    ("zipf", "expected lognormal:<skew> or a path to a .json trace"),
    ("lognormal:-1", "the skew must be a number >= 0"),
    ("lognormal:abc", "the skew must be a number >= 0"),
    ("missing.json", "missing.json"),
])
def test_bad_load_specs_are_one_line(spec, words):
    with pytest.raises(ValueError) as error:
        parse_load(spec)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_recorded_trace_replays_as_is_and_checks_its_layout(tmp_path):
    peers, experts, tokens = 4, 8, 6
    recorder = TraceRecorder(str(tmp_path / "t.json"), peers=peers, rank=1, source="test")
    maps = []
    for microbatch in range(3):
        gen = torch.Generator().manual_seed(microbatch)
        routing = torch.rand(tokens * peers, experts, generator=gen) < 0.25
        maps.append(routing)
        recorder.record(layer=5, routing_map=routing)
    trace = recorder.write(topk=2, microbatches_per_step=3)
    assert trace["format"] == peer_load.TRACE_FORMAT and trace["tokens_per_peer"] == tokens
    load = parse_load(str(tmp_path / "t.json"))
    shape = RouteShape(tokens, 2, experts, peers, rank=1)
    load.check(shape)
    for microbatch, routing in enumerate(maps):
        # sequence p of the microbatch is peer p; rank 1 holds experts 2 and 3
        per_peer = routing.reshape(tokens, peers, experts).sum(0)[:, 2:4]
        for peer in range(peers):
            rows = load.rows(shape, step=0, layer=5, microbatch=microbatch, peer=peer)
            assert rows.tolist() == per_peer[peer].tolist()
    # the next step wraps around to the first recorded microbatch
    assert load.rows(shape, 1, 5, 0, 2).tolist() == load.rows(shape, 0, 5, 0, 2).tolist()
    with pytest.raises(ValueError, match="has no layer 6"):
        load.rows(shape, 0, 6, 0, 0)
    with pytest.raises(ValueError) as error:
        load.check(RouteShape(tokens, 2, experts * 2, peers, rank=1))
    assert "num_experts=8" in str(error.value) and "\n" not in str(error.value)


# -- keys and fills ----------------------------------------------------------------------------


def test_forward_keys_count_microbatches_and_recomputes_reuse_them(monkeypatch):
    from megatron_paging.mcore import peers as peers_module

    peers = peers_module.EmulatedPeers(LognormalLoad(0.0))
    peers.begin_step()
    keys = [peers.forward_key(3) for _ in range(3)] + [peers.forward_key(4)]
    assert [(k.step, k.layer, k.microbatch) for k in keys] == [
        (0, 3, 0), (0, 3, 1), (0, 3, 2), (0, 4, 0)]
    # a recompute inside the backward repeats the oldest forward not yet recomputed
    monkeypatch.setattr(peers_module, "_graph_task", lambda: 1)
    assert [peers.forward_key(3).microbatch for _ in range(3)] == [0, 1, 2]
    monkeypatch.setattr(peers_module, "_graph_task", lambda: -1)
    peers.begin_step()
    assert peers.forward_key(3) == peers_module.ExchangeKey(1, 3, 0)


def test_row_fills_are_deterministic_in_place_and_keep_the_own_block():
    from megatron_paging.mcore.peers import EmulatedPeers, ExchangeKey

    ep, block, width, rank = 4, 5, 3, 2
    inp = torch.arange(ep * block * width, dtype=torch.float32).reshape(ep * block, width)
    key = ExchangeKey(0, 7, 1)

    def fill(direction="dispatch", backward=False, seed=0, key=key):
        out = torch.full_like(inp, float("nan"))
        storage = out.data_ptr()
        EmulatedPeers(LognormalLoad(0.0), seed).fill_rows(key, direction, backward, out, inp,
                                                          rank, ep)
        assert out.data_ptr() == storage and torch.isfinite(out).all()
        return out.view(ep, block, width)

    out = fill()
    assert torch.equal(out[rank], inp.view(ep, block, width)[rank])  # the real self-send
    assert torch.equal(fill(), out)
    for other in (fill("combine"), fill(backward=True), fill(seed=1),
                  fill(key=ExchangeKey(0, 7, 2))):
        assert not torch.equal(other[0], out[0]) and torch.equal(other[rank], out[rank])
    assert fill(backward=True)[0].abs().max() < 0.1 < out[0].abs().max()  # gradients are small


def test_pipeline_receives_fill_in_place_in_order():
    from megatron_paging.mcore.peers import EmulatedPeers

    peers = EmulatedPeers(LognormalLoad(0.0))
    received = [torch.empty(6, 2, 4, requires_grad=True) for _ in range(3)]
    for tensor in received:
        peers.fill_received(tensor, "p2p-forward")
    assert all(torch.isfinite(t).all() for t in received)
    assert not torch.equal(received[0], received[1])
    again = EmulatedPeers(LognormalLoad(0.0))
    first = torch.empty(6, 2, 4)
    again.fill_received(first, "p2p-forward")
    assert torch.equal(first, received[0].detach())
    grad = torch.empty(6, 2, 4)
    again.fill_received(grad, "p2p-backward")
    assert grad.abs().max() < 0.1


# -- one emulated EP rank of a real MoE layer (fake process group, CPU) -----------------------


def test_an_emulated_ep_rank_pages_bit_for_bit_and_deterministically():
    pytest.importorskip("megatron.core")
    spec = {"world": 8, "ep": 8, "rank": 3, "experts": 16,
            "runs": [{"paged": False, "load": "lognormal:0.3"},
                     {"paged": True, "load": "lognormal:0.3"},
                     {"paged": True, "load": "lognormal:0.3"},
                     {"paged": True, "load": "lognormal:1.5", "capacity_factor": 1.0},
                     {"paged": False, "load": "lognormal:3.0", "budgetless": True, "steps": 6}]}
    result = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    unpaged, paged, again, skewed, budgetless = json.loads(
        result.stdout.strip().splitlines()[-1])
    assert paged["mode"] == "paged" and all(paged["free"])  # paged through pools, all back
    assert not any(step["overflow"] for step in paged["steps"])
    assert paged["steps"] == unpaged["steps"]  # losses, parameter and input grads: bitwise
    assert again == paged  # two runs with one seed: identical
    for step in paged["steps"]:
        assert all(np.isfinite(float.fromhex(v)) for v in step["losses"] + step["grads"])
        # live rows: this rank's own routes plus what 7 emulated peers sent, below capacity
        assert 0 < sum(step["live"]) < paged["capacity_rows"]
    assert paged["received_rows"] > 0 and paged["dropped_rows"] == 0
    # a skewed load on a tight budget: emulated senders drop what exceeds the per-pair block
    assert skewed["dropped_rows"] > 0
    assert all(sum(step["live"]) <= skewed["capacity_rows"] for step in skewed["steps"])
    # without a static budget (an over-budget step's rerun) blocks fit the largest pair,
    # emulated peers' included: nothing is dropped
    assert budgetless["dropped_rows"] == 0 and budgetless["received_rows"] > 0


def _emulated_step(peers):
    """What one forward-backward of a 2-microbatch, 2-layer stage receives from its peers."""
    from megatron_paging.tools.peer_load import RouteShape

    received = []
    for _ in range(2):
        tensor = torch.empty(4, 3)
        peers.fill_received(tensor, "p2p-forward")
        received.append(tensor)
        for layer in (1, 2):
            key = peers.forward_key(layer)
            counts = torch.zeros(4, 2, dtype=torch.int64)
            peers.fill_counts(key, counts, counts.clone(), 0, RouteShape(16, 2, 8, 4, 0), 64)
            rows = torch.empty(8, 3)
            peers.fill_rows(key, "dispatch", False, rows, torch.zeros(8, 3), 0, 4)
            received += [counts, rows]
    return received


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_rerun_step_receives_what_its_first_attempt_received(monkeypatch):
    """A step run again (overflow 'rerun') is keyed by Megatron's iteration, not by the count of
    forward-backward calls: it receives its first attempt's rows, and the steps after it
    receive what a run without the rerun receives."""
    from types import SimpleNamespace

    import megatron.training.global_vars as global_vars

    from megatron_paging.mcore.installer import FinishingForwardBackward
    from megatron_paging.mcore.peers import EmulatedPeers

    def run(calls):
        peers = EmulatedPeers(LognormalLoad(0.3))
        seen = []
        step = FinishingForwardBackward(lambda **_: seen.append(_emulated_step(peers)), None,
                                        peers)
        for iteration, forward_only in calls:
            monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                                SimpleNamespace(curr_iteration=iteration))
            step(forward_only=forward_only)
        return seen

    plain = run([(i, False) for i in range(4)])
    # step 1 run again, then an evaluation at that iteration
    rerun = run([(0, False), (1, False), (1, False), (1, True), (2, False), (3, False)])
    first, again, evaluation = rerun[1], rerun[2], rerun[3]
    assert _same(first, plain[1]) and _same(again, first)
    assert _same(rerun[4], plain[2]) and _same(rerun[5], plain[3])
    assert not _same(evaluation, first) and not _same(evaluation, plain[2])
    assert not _same(plain[1], plain[2])


def test_peers_refuse_a_bad_step():
    from megatron_paging.mcore.peers import EVALUATION_STEPS, EmulatedPeers

    peers = EmulatedPeers(LognormalLoad(0.0))
    for bad in (-1, EVALUATION_STEPS, 1.5):
        with pytest.raises(ValueError, match="step"):
            peers.begin_step(bad)
    peers.begin_step(5)
    peers.begin_step()
    assert peers.step == 6
