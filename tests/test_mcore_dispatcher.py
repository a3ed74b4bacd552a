"""The static-capacity dispatch backend inside Megatron-Core's MoEFlexTokenDispatcher (CPU, EP=1):
permutation layout, permute/unpermute round trip, gradients, over-budget flag."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_fixtures import installed, model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.mcore.dispatcher import PagingFlexTokenDispatcher  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK = 24, 16, 4, 2


def _dispatcher(model_parallel, **config):  # noqa: F811
    assert model_parallel is not None
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    cfg = moe_config(hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, **config)
    return PagingFlexTokenDispatcher(
        EXPERTS, list(range(EXPERTS)), cfg, pg_collection=get_default_pg_collection()
    )


def _routing(seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    if skew:  # every token prefers experts 0 and 1: piles routes onto two experts
        logits[:, :2] += 10.0
    top = logits.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(routing_map, logits.softmax(-1), torch.zeros(()))
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    return hidden, routing_map, probs


def _run(dispatcher, hidden, routing_map, probs, expert_fn):
    x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    y, p = dispatcher.token_dispatch(x, p)
    y, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(y, p)
    out = expert_fn(y, permuted_probs)
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(out))
    )
    return y, tokens_per_expert, permuted_probs, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permutation_layout_and_round_trip(installed, model_parallel, seed):  # noqa: F811
    dispatcher = _dispatcher(model_parallel, moe_expert_rank_capacity_factor=1.5)
    hidden, routing_map, probs = _routing(seed)
    y, tpe, pprobs, out = _run(dispatcher, hidden, routing_map, probs, lambda y, p: y * p[:, None])

    budget = dispatcher._comm_manager.num_permuted_tokens
    assert y.shape == (budget, HIDDEN) and budget >= int(TOKENS * TOPK * 1.5)
    assert torch.equal(tpe, routing_map.sum(0))  # within budget: nothing dropped
    # Rows are grouped by expert, tokens in order; the tail past the live rows is zero.
    start = 0
    for e in range(EXPERTS):
        tokens = routing_map[:, e].nonzero().flatten()
        assert torch.equal(y[start : start + len(tokens)], hidden[tokens])
        assert torch.equal(pprobs[start : start + len(tokens)], probs[tokens, e])
        start += len(tokens)
    assert not y[start:].any() and not pprobs[start:].any()
    # Unpermute inverts permute: combine sums each token's weighted routes.
    expected = (hidden[:, None, :] * probs[:, :, None]).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert not bool(dispatcher.check_over_budget())


def test_gradients_match_a_dense_reference(installed, model_parallel):  # noqa: F811
    dispatcher = _dispatcher(model_parallel)
    hidden, routing_map, probs = _routing(3)
    weight = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))

    def expert(y, p):
        return torch.tanh(y @ weight) * p[:, None]

    h1, p1 = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    *_, out = _run(dispatcher, h1, routing_map, p1, expert)
    out.square().sum().backward()

    h2, p2 = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    dense = (torch.tanh(h2 @ weight)[:, None, :] * p2[:, :, None]).sum(1)
    dense.square().sum().backward()
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1.grad * routing_map, p2.grad * routing_map, rtol=1e-5, atol=1e-5)


def test_split_into_schedule_nodes_each_node_gets_its_input_gradients(
    installed, model_parallel  # noqa: F811
):
    """Combined 1F1B runs preprocess, dispatch and the experts as separate schedule nodes on
    detached inputs and runs each node's backward on its own. Each node must read the tensors it
    was handed (not the manager's copies from the node before), so that every detached input gets
    its gradient, equal to the unsplit run's."""
    weight = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))
    hidden, routing_map, probs = _routing(4)

    def expert(y, p):
        return torch.tanh(y @ weight) * p[:, None]

    reference = _dispatcher(model_parallel)
    h_ref, p_ref = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    *_, out_ref = _run(reference, h_ref, routing_map, p_ref, expert)
    out_ref.square().sum().backward()

    dispatcher = _dispatcher(model_parallel)
    h, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    x, token_probs = dispatcher.dispatch_preprocess(h, routing_map, p)  # the router's node
    x_in, probs_in = x.detach().requires_grad_(), token_probs.detach().requires_grad_()
    y, dispatched_probs = dispatcher.token_dispatch(x_in, probs_in)  # the dispatch node
    y_in, dprobs_in = y.detach().requires_grad_(), dispatched_probs.detach().requires_grad_()
    rows, _, permuted_probs = dispatcher.dispatch_postprocess(y_in, dprobs_in)  # the experts' node
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(expert(rows, permuted_probs))))

    out.square().sum().backward()  # the experts' node backward: its own inputs only
    assert y_in.grad is not None and dprobs_in.grad is not None
    torch.autograd.backward((y, dispatched_probs), (y_in.grad, dprobs_in.grad))
    assert x_in.grad is not None and probs_in.grad is not None
    torch.autograd.backward((x, token_probs), (x_in.grad, probs_in.grad))
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0)


def test_dispatch_is_deterministic(installed, model_parallel):  # noqa: F811
    dispatcher = _dispatcher(model_parallel)
    hidden, routing_map, probs = _routing(4)
    results = []
    for _ in range(2):
        h = hidden.clone().requires_grad_()
        *_, out = _run(dispatcher, h, routing_map, probs, lambda y, p: y * p[:, None])
        out.sum().backward()
        results.append((out.detach(), h.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_over_budget_drops_routes_and_sets_the_sticky_flag(installed, model_parallel):  # noqa: F811
    dispatcher = _dispatcher(model_parallel, moe_expert_rank_capacity_factor=0.5)
    hidden, routing_map, probs = _routing(5, skew=True)
    y, tpe, _, out = _run(dispatcher, hidden, routing_map, probs, lambda y, p: y * p[:, None])
    budget = dispatcher._comm_manager.num_permuted_tokens
    assert budget < TOKENS * TOPK
    assert int(tpe.sum()) == budget  # the budget is full, the rest was dropped
    assert torch.equal(
        tpe,
        torch.minimum(routing_map.sum(0).cumsum(0), torch.tensor(budget)).diff(
            prepend=torch.zeros(1, dtype=torch.int64)
        ),
    )
    assert bool(dispatcher.check_over_budget())
    # The flag is sticky across microbatches until reset.
    _run(dispatcher, *_routing(6)[:3], lambda y, p: y * p[:, None])
    assert bool(dispatcher.check_over_budget())
    dispatcher.reset_over_budget()
    assert not bool(dispatcher.check_over_budget())
    # Dropped routes contribute nothing: tokens whose routes all survived are exact.
    kept = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool)
    start = 0
    for e in range(EXPERTS):
        tokens = routing_map[:, e].nonzero().flatten()
        kept[tokens[: max(0, min(len(tokens), budget - start))], e] = True
        start += len(tokens)
    expected = (hidden[:, None, :] * (probs * kept)[:, :, None]).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_rerun_without_capacity_factor_sizes_exactly(installed, model_parallel):  # noqa: F811
    dispatcher = _dispatcher(model_parallel, moe_expert_rank_capacity_factor=0.5)
    dispatcher._comm_manager.moe_expert_rank_capacity_factor = None  # what the runner does
    hidden, routing_map, probs = _routing(5, skew=True)
    y, tpe, _, out = _run(dispatcher, hidden, routing_map, probs, lambda y, p: y * p[:, None])
    assert y.shape[0] == int(routing_map.sum()) and torch.equal(tpe, routing_map.sum(0))
    torch.testing.assert_close(out, (hidden[:, None, :] * probs[:, :, None]).sum(1))
    assert not bool(dispatcher.check_over_budget())


def test_static_backend_rejects_expert_tensor_parallel_mismatch(installed, model_parallel):  # noqa: F811
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    cfg = moe_config(hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK)
    with pytest.raises(ValueError, match="num_experts=4 is not num_local_experts=3"):
        PagingFlexTokenDispatcher(3, [0, 1, 2], cfg, pg_collection=get_default_pg_collection())


def _ep2_worker(rank: int, port: int, capacity_factor, skew: bool, backend: str = "gloo"):
    """One rank of an EP=2 group (gloo on CPUs, or NCCL with one GPU per rank): dispatch ->
    per-expert scale -> combine vs a reference."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_paging.mcore.dispatcher import StaticCapacityManager

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        config = SimpleNamespace(
            moe_router_topk=TOPK,
            moe_expert_rank_capacity_factor=capacity_factor,
            use_transformer_engine_op_fuser=False,
            fp8=None,
            fp4=None,
        )
        manager = StaticCapacityManager(dist.group.WORLD, EXPERTS // 2, EXPERTS, config)
        hidden, routing_map, probs = (t.to(device) for t in _routing(10 + rank, skew=skew))
        hidden.requires_grad_()
        probs.requires_grad_()
        manager.setup_metadata(routing_map, probs)
        y = manager.dispatch(hidden)
        tpe = manager.get_number_of_tokens_per_expert()
        _, pprobs = manager.get_permuted_hidden_states_by_experts(y)
        # Local expert l of this rank is global expert 2 * rank + l: scale its rows by (g + 1).
        scale = torch.repeat_interleave(
            torch.arange(2, dtype=torch.float32, device=device) + 2 * rank + 1,
            tpe,
            output_size=int(tpe.sum()),
        )
        scale = torch.cat([scale, torch.zeros(y.shape[0] - scale.shape[0], device=device)])
        out = manager.combine(y * (pprobs * scale)[:, None])
        out.square().sum().backward()

        # What survived the budget on this rank's side, per (token, expert).
        kept = routing_map.clone()
        if capacity_factor is not None:
            block = manager.block_rows
            for dest in range(2):
                seen = 0
                for local in range(2):
                    for t in routing_map[:, 2 * dest + local].nonzero().flatten().tolist():
                        kept[t, 2 * dest + local] = seen < block
                        seen += 1
        h2, p2 = hidden.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        weights = p2 * kept * (torch.arange(EXPERTS, dtype=torch.float32, device=device) + 1)
        ref = (h2[:, None, :] * weights[:, :, None]).sum(1)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(probs.grad * kept, p2.grad * kept, rtol=1e-5, atol=1e-5)
        dropped = bool((routing_map & ~kept).any())
        assert bool(manager.over_budget) == dropped
        flags = torch.tensor([int(dropped)], device=device)
        dist.all_reduce(flags)
        if skew and capacity_factor is not None:
            assert int(flags) > 0, "the skewed routing should overflow a 0.5 budget"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("capacity_factor, skew", [(1.5, False), (0.5, True), (None, True)])
def test_expert_parallel_two_ranks_over_gloo(capacity_factor, skew):
    """EP=2 on the CPU: fixed-size all-to-all blocks, regrouping, combine, gradients."""
    import torch.multiprocessing as mp
    from mcore_fixtures import free_port

    mp.spawn(_ep2_worker, args=(free_port(), capacity_factor, skew), nprocs=2)


@pytest.mark.multigpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices, found {torch.cuda.device_count()}",
)
@pytest.mark.parametrize("capacity_factor, skew", [(1.5, False), (0.5, True)])
def test_expert_parallel_two_gpus_over_nccl(capacity_factor, skew):
    """EP=2 with one GPU per rank over NCCL: the same contract as the gloo test, device-side."""
    import torch.multiprocessing as mp
    from mcore_fixtures import free_port

    mp.spawn(_ep2_worker, args=(free_port(), capacity_factor, skew, "nccl"), nprocs=2)
