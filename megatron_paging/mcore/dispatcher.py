"""A sync-free static-capacity dispatch backend for Megatron-Core's ``MoEFlexTokenDispatcher``.

Select it with ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend static`` (after
:func:`megatron_paging.mcore.install`). It honours ``_HybridEPManager``'s contract in
plain PyTorch, without HybridEP, NCCL-EP or Transformer Engine:

* a static permuted-token budget ``num_permuted_tokens = ceil(tokens x topk x
  moe_expert_rank_capacity_factor)`` rows (rounded up to the quantization alignment): the expert
  input is always that many rows, grouped by local expert, live rows first;
* ``tokens_per_expert`` stays on the device (no host sync anywhere in dispatch or combine);
* routes beyond the budget are dropped and set the sticky device flag ``over_budget``
  (``check_over_budget`` / ``reset_over_budget`` on the dispatcher, read by the step runner);
* ``moe_expert_rank_capacity_factor = None`` (the runner's unpaged rerun) sizes the buffer to the
  exact routed count instead: one host read, no drops.

EP = 1 permutes locally. EP > 1 sends a fixed-size block of ``ceil(budget / ep)`` rows to every
rank with one ``all_to_all_single`` (plus one for the per-expert counts), then regroups the
received blocks by local expert on the device. Under Megatron's ``--fake-process-group`` those
exchanges are no-ops and :class:`~megatron_paging.mcore.peers.EmulatedPeers` (set as
``StaticCapacityManager.peers`` by ``install()``) writes what the other ranks would have sent.

Every data movement is a gather (:class:`_IndexedSum`) whose backward is the inverse gather, so
forward and backward are deterministic (no atomics) and rows past the live prefix are never
read: their content (for example a reloaded page's untouched tail) cannot leak into results.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import (
    MoEFlexTokenDispatcher,
    MoETokenDispatcher,
    _DispatchManager,
)

STATIC_BACKEND = "static"


class _IndexedSum(torch.autograd.Function):
    """``out[o] = sum_k x[fwd_index[o, k]] where fwd_valid[o, k]``; backward is the same with
    ``bwd_index`` / ``bwd_valid`` (the inverse map). Sums over k > 1 accumulate in fp32."""

    @staticmethod
    def forward(ctx, x, fwd_index, fwd_valid, bwd_index, bwd_valid):
        ctx.save_for_backward(bwd_index, bwd_valid)
        _read_on_this_stream(fwd_index, fwd_valid)
        return _indexed_sum(x, fwd_index, fwd_valid)

    @staticmethod
    def backward(ctx, grad):
        bwd_index, bwd_valid = ctx.saved_tensors
        _read_on_this_stream(bwd_index, bwd_valid)
        return _indexed_sum(grad.contiguous(), bwd_index, bwd_valid), None, None, None, None


def _read_on_this_stream(*tensors: torch.Tensor) -> None:
    """Tell the caching allocator that the current stream reads ``tensors``. Under combined
    1F1B (``--overlap-moe-expert-parallel-comm``) dispatch and combine, forward and backward,
    run on a communication stream, while their index tensors were made on the compute stream:
    freed there (a step's maps replaced, a backward's saved tensors released) they could be
    handed to a new compute-stream tensor while a gather still reads them. On one stream this
    is a no-op; inside a CUDA-graph capture the graph's memory pool keeps them anyway."""
    if not tensors[0].is_cuda or torch.cuda.is_current_stream_capturing():
        return
    stream = torch.cuda.current_stream(tensors[0].device)
    for tensor in tensors:
        tensor.record_stream(stream)


def _indexed_sum(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if index.shape[1] == 1:
        rows = x.index_select(0, index[:, 0])
        return torch.where(valid[:, :1], rows, torch.zeros((), dtype=x.dtype, device=x.device))
    acc = None
    for k in range(index.shape[1]):
        rows = x.index_select(0, index[:, k]).float()
        rows = torch.where(valid[:, k : k + 1], rows, torch.zeros((), device=x.device))
        acc = rows if acc is None else acc + rows
    return acc.to(x.dtype)


class _RouteProbs(torch.autograd.Function):
    """The router prob of every sent row: ``probs[t, e]`` of its (expert, token) pair.

    Backward writes each row's gradient back to its (token, expert) slot through the combine map
    and a one-hot sum over the token's k routes (distinct experts, so every slot receives at
    most one term): no scatter-add, deterministic in any mode."""

    @staticmethod
    def forward(ctx, probs, pair_index, valid, token_row, token_valid, top_expert):
        ctx.save_for_backward(token_row, token_valid, top_expert)
        _read_on_this_stream(pair_index, valid)
        ctx.num_experts = probs.shape[1]
        flat = probs.t().reshape(-1)
        rows = flat.index_select(0, pair_index)
        return torch.where(valid, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    @staticmethod
    def backward(ctx, grad):
        token_row, token_valid, top_expert = ctx.saved_tensors
        _read_on_this_stream(token_row, token_valid, top_expert)
        per_route = grad.index_select(0, token_row.reshape(-1)).view(token_row.shape)
        per_route = torch.where(
            token_valid, per_route, torch.zeros((), dtype=grad.dtype, device=grad.device)
        )
        one_hot = torch.nn.functional.one_hot(top_expert, ctx.num_experts).to(grad.dtype)
        grad_probs = (one_hot * per_route.unsqueeze(-1)).sum(1)
        return grad_probs, None, None, None, None, None


@dataclass(frozen=True)
class _Emulation:
    """Where emulated peers write one exchange's output (see :mod:`.peers`)."""

    peers: object
    key: object
    direction: str
    rank: int
    ep: int

    def fill(self, out: torch.Tensor, inp: torch.Tensor, backward: bool) -> None:
        self.peers.fill_rows(self.key, self.direction, backward, out, inp, self.rank, self.ep)


class _FixedAllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal blocks; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, emulation):
        ctx.group, ctx.emulation = group, emulation
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        if emulation is not None:
            emulation.fill(out, x, backward=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        if ctx.emulation is not None:
            ctx.emulation.fill(out, grad, backward=True)
        return out, None, None


@torch.compiler.disable
def _exchange_counts(manager: StaticCapacityManager, send_counts: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """The per-(rank, local expert) counts exchange (outside torch.compile: emulated peers run
    host code here)."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=manager.group)
    if manager.peers is not None:
        manager.exchange_key = manager.peers.exchange_counts(manager, recv, send_counts,
                                                             num_tokens)
    return recv


def _slot_positions(mask: torch.Tensor, capacity: int):
    """For a bool ``[blocks, n]`` mask: each set entry's position inside its block (in order),
    whether it fits in ``capacity`` rows, and the rows kept per block."""
    pos = torch.cumsum(mask.to(torch.int64), dim=-1) - 1
    keep = mask & (pos < capacity)
    return pos, keep, keep.sum(-1)


class StaticCapacityManager(_DispatchManager):
    """``_HybridEPManager``'s contract in plain PyTorch (see the module docstring)."""

    # Emulated EP peers (``--fake-process-group``): set by install(), None in a real job.
    peers = None
    # A real router's routes as a peer-load trace (examples/; None unless recording).
    load_recorder = None

    def __init__(self, group, num_local_experts: int, num_experts: int, config):
        self.group = group
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts
        self.config = config
        self.world_size = group.size() if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None and self.world_size > 1 else 0
        self.layer_number = 0  # set by MoELayer.set_layer_number (install())
        self.exchange_key = None
        if num_experts != num_local_experts * self.world_size:
            raise ValueError(
                f"static dispatch: num_experts={num_experts} is not num_local_experts="
                f"{num_local_experts} x group size {self.world_size} (expert TP > 1 is not "
                "supported by the static backend)"
            )
        self.moe_expert_rank_capacity_factor = config.moe_expert_rank_capacity_factor
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.over_budget = torch.zeros(1, dtype=torch.bool, device=device)
        self.num_permuted_tokens = None
        self.tokens_per_expert = None
        self.token_probs = None
        self.dispatched_probs = None

    # -- budget -----------------------------------------------------------------------------
    def _block_rows(self, num_tokens: int, routing_map: torch.Tensor) -> int:
        """Rows sent to each rank: the static budget split evenly over the group."""
        if self.moe_expert_rank_capacity_factor is None:
            # Unpaged rerun: the largest routed count of any (sender, receiver) pair, exactly
            # (one host read, as HybridEP's dynamic mode); nothing is dropped.
            routed = routing_map.sum(dim=(0, 2)).max().reshape(1)
            if self.world_size > 1:
                dist.all_reduce(routed, op=dist.ReduceOp.MAX, group=self.group)
            if self.peers is not None:  # the fake group's MAX saw only this rank's pairs
                return max(1, int(routed.item()), self.peers.largest_sent(self, num_tokens))
            return max(1, int(routed.item()))
        budget = math.ceil(
            num_tokens * self.config.moe_router_topk * self.moe_expert_rank_capacity_factor
        )
        align = max(1, get_align_size_for_quantization(self.config))
        budget += -budget % align
        return max(1, -(-max(budget, align) // self.world_size))

    # -- metadata ---------------------------------------------------------------------------
    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        num_tokens = routing_map.shape[0]
        ep, n_local = self.world_size, self.num_local_experts
        routing_map = routing_map.reshape(num_tokens, ep, n_local)
        probs = probs.reshape(num_tokens, ep, n_local)
        self.token_probs = probs
        self.num_tokens = num_tokens
        block = self._block_rows(num_tokens, routing_map)
        self.block_rows = block
        self.num_permuted_tokens = block * ep
        device = routing_map.device

        # Sender side: per destination rank, (local expert, token) pairs in that order; the
        # kept ones fill the rank's block densely, so slot r holds the (r+1)-th kept pair.
        mask = routing_map.permute(1, 2, 0).reshape(ep, n_local * num_tokens)
        pos, keep, sent_rows = _slot_positions(mask, block)
        self._send_over_budget = (mask & ~keep).any()
        kept_before = torch.cumsum(keep.to(torch.int64), dim=-1)
        slot = torch.arange(block, device=device)
        row_pair = torch.searchsorted(kept_before, (slot + 1).expand(ep, -1).contiguous())
        row_pair = row_pair.clamp(max=n_local * num_tokens - 1)
        row_valid = slot[None, :] < sent_rows[:, None]
        self._send_token = (row_pair % num_tokens).reshape(-1, 1)
        self._send_valid = row_valid.reshape(-1, 1)
        send_counts = keep.reshape(ep, n_local, num_tokens).sum(-1)  # [ep, n_local]

        # Combine map: for every token and each of its routes, the sent row (rank-major).
        topk = min(self.config.moe_router_topk, ep * n_local)
        flat_route = routing_map.reshape(num_tokens, ep * n_local)
        _, top_expert = torch.topk(flat_route.to(torch.float32), k=topk, dim=1, sorted=False)
        top_expert, _ = torch.sort(top_expert, dim=1)
        route_rank, route_local = top_expert // n_local, top_expert % n_local
        token = torch.arange(num_tokens, device=device)[:, None]
        pair_index = route_local * num_tokens + token
        route_keep = keep[route_rank, pair_index] & flat_route.gather(1, top_expert)
        self._token_row = route_rank * block + pos[route_rank, pair_index].clamp(0, block - 1)
        self._token_valid = route_keep
        self._top_expert = top_expert
        # Global (expert, token) index of every sent row, for the probs gather.
        rank_offset = torch.arange(ep, device=device)[:, None] * (n_local * num_tokens)
        self._send_pair = (rank_offset + row_pair).reshape(-1)

        # Receiver side: counts per (source rank, local expert) and the regrouping maps.
        if ep > 1:
            recv_counts = _exchange_counts(self, send_counts, num_tokens)
        else:
            recv_counts = send_counts
            if self.load_recorder is not None:
                _record(self, routing_map)
        self._build_regroup(recv_counts, block)

    def _build_regroup(self, recv_counts: torch.Tensor, block: int):
        """Maps between received blocks ``[src rank, block]`` and expert-major rows."""
        ep, n_local = recv_counts.shape
        device = recv_counts.device
        per_expert = recv_counts.sum(0)  # [n_local]
        expert_start = torch.cumsum(per_expert, 0) - per_expert
        src_start = torch.cumsum(recv_counts, 0) - recv_counts  # offset inside the expert
        block_start = torch.cumsum(recv_counts, 1) - recv_counts  # offset inside the block
        i = torch.arange(block, device=device)
        block_end = torch.cumsum(recv_counts, 1)
        # Local expert of received row i of block s (rows past the block's total are invalid).
        local = torch.searchsorted(block_end, i.expand(ep, -1).contiguous(), right=True)
        recv_valid = local < n_local
        local = local.clamp(max=n_local - 1)
        s = torch.arange(ep, device=device)[:, None]
        out_row = expert_start[local] + src_start[s, local] + (i - block_start[s, local])
        total = ep * block
        out_row = torch.where(recv_valid, out_row, total)
        recv_index = (s * block + i).reshape(-1)
        inverse = torch.zeros(total + 1, dtype=torch.int64, device=device)
        inverse.scatter_(0, out_row.reshape(-1), recv_index)
        live = per_expert.sum()
        self._recv_row = out_row.clamp(max=total - 1).reshape(-1, 1)  # received row -> out row
        self._recv_valid = recv_valid.reshape(-1, 1)
        self._out_row = inverse[:total].reshape(-1, 1)  # out row -> received row
        self._out_valid = (torch.arange(total, device=device) < live).reshape(-1, 1)
        self.tokens_per_expert = per_expert.to(torch.int64)

    # -- dispatch / combine -----------------------------------------------------------------
    def dispatch(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        send = _IndexedSum.apply(
            hidden_states, self._send_token, self._send_valid, self._token_row, self._token_valid
        )
        probs = _RouteProbs.apply(
            self.token_probs.reshape(self.num_tokens, -1),
            self._send_pair,
            self._send_valid.reshape(-1),
            self._token_row,
            self._token_valid,
            self._top_expert,
        ).reshape(-1, 1)
        if self.world_size > 1:
            send = _FixedAllToAll.apply(send, self.group, self._emulation("dispatch"))
            probs = _FixedAllToAll.apply(probs, self.group, self._emulation("probs"))
        out = _IndexedSum.apply(
            send, self._out_row, self._out_valid, self._recv_row, self._recv_valid
        )
        self.dispatched_probs = _IndexedSum.apply(
            probs, self._out_row, self._out_valid, self._recv_row, self._recv_valid
        ).reshape(-1)
        if self.moe_expert_rank_capacity_factor is not None:
            self.over_budget |= self._send_over_budget
        return out

    def combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        blocks = _IndexedSum.apply(
            hidden_states, self._recv_row, self._recv_valid, self._out_row, self._out_valid
        )
        if self.world_size > 1:
            blocks = _FixedAllToAll.apply(blocks, self.group, self._emulation("combine"))
        return _IndexedSum.apply(
            blocks, self._token_row, self._token_valid, self._send_token, self._send_valid
        )

    def _emulation(self, direction: str) -> _Emulation | None:
        if self.peers is None:
            return None
        return _Emulation(self.peers, self.exchange_key, direction, self.rank, self.world_size)

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        return hidden_states, self.dispatched_probs

    def get_restored_hidden_states_by_experts(self, hidden_states):
        return hidden_states

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert


@torch.compiler.disable
def _record(manager: StaticCapacityManager, routing_map: torch.Tensor) -> None:
    """One training forward's routes into the trace recorder (not a recompute's repeat)."""
    if torch.is_grad_enabled() and getattr(torch._C, "_current_graph_task_id", lambda: -1)() < 0:
        manager.load_recorder.record(manager.layer_number, routing_map.reshape(
            routing_map.shape[0], -1))


def numbering_dispatcher(set_layer_number):
    """``MoELayer.set_layer_number`` that also tells a static dispatcher its layer's global
    number (what emulated peers and load traces key on)."""

    @functools.wraps(set_layer_number)
    def wrapped(self, layer_number):
        set_layer_number(self, layer_number)
        manager = getattr(self.token_dispatcher, "_comm_manager", None)
        if isinstance(manager, StaticCapacityManager):
            manager.layer_number = int(layer_number)

    return wrapped


def keeping_expert_inputs(should_free_input):
    """Megatron-Core's ``should_free_input`` (which combined-1F1B schedule nodes free their input
    storage after forward) that, with the static backend, keeps the ``moe_dispatch`` and ``mlp``
    nodes' inputs, as Megatron-Core does for HybridEP.

    Megatron-Core frees them for the other flex backends, whose pre- and post-dispatch steps make
    permuted copies. The static backend passes tensors through as they are: the dispatch input is
    the router's input (which the router saves), the experts' input is the dispatched buffer
    (which the experts save, with the dispatched probabilities). Freed, a backward reads
    released memory (an illegal address)."""

    @functools.wraps(should_free_input)
    def wrapped(name, is_moe, config, num_local_experts):
        if (name in ("moe_dispatch", "mlp")
                and getattr(config, "moe_flex_dispatcher_backend", None) == STATIC_BACKEND):
            return False
        return should_free_input(name, is_moe, config, num_local_experts)

    return wrapped


class PagingFlexTokenDispatcher(MoEFlexTokenDispatcher):
    """``MoEFlexTokenDispatcher`` plus the ``static`` backend; other backends are Megatron's."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        if config.moe_flex_dispatcher_backend != STATIC_BACKEND:
            super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
            return
        MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self._comm_manager = StaticCapacityManager(
            group=self.tp_ep_group,
            num_local_experts=num_local_experts,
            num_experts=self.tp_size * config.num_moe_experts,
            config=config,
        )
        self.cudagraph_attrs = ["_comm_manager.token_probs"]

    # Combined 1F1B runs dispatch and the experts as separate schedule nodes, each on detached
    # inputs; the probabilities the manager reads must be the ones each step was handed, or a
    # node's backward reaches into its neighbour's graph and its own input gets no gradient.
    # Megatron-Core does the same for DeepEP and HybridEP in its layer callables. Elsewhere the
    # tensor handed over is the manager's own (a no-op).
    def token_dispatch(self, hidden_states, probs=None, async_finish=True,
                       allocate_on_comm_stream=True):
        if probs is not None and isinstance(self._comm_manager, StaticCapacityManager):
            self._comm_manager.token_probs = probs
        return super().token_dispatch(hidden_states, probs, async_finish, allocate_on_comm_stream)

    def dispatch_postprocess(self, hidden_states, probs):
        if isinstance(self._comm_manager, StaticCapacityManager):
            self._comm_manager.dispatched_probs = probs
        return super().dispatch_postprocess(hidden_states, probs)


__all__ = [
    "PagingFlexTokenDispatcher", "STATIC_BACKEND", "StaticCapacityManager",
    "keeping_expert_inputs", "numbering_dispatcher",
]
