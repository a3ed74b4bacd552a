"""EMULATED PEERS: one rank of a large Megatron job on one GPU (``--fake-process-group``).

Megatron's fake process group builds every process group of the target layout in one process and
turns every collective into a no-op. This rank's own compute, memory, paging, scheduler and
optimizer are real; what other ranks would send it is not. :class:`EmulatedPeers` writes it where
each collective's output lands, and nowhere else:

* the static dispatcher's EP exchange (:mod:`.dispatcher`): the per-expert counts (from a
  :mod:`megatron_paging.tools.peer_load` model or a recorded trace, capped at the per-pair budget
  as the sending dispatcher caps them), and the rows of every all-to-all, forward and backward;
  this rank's own block is copied from its input, as the real exchange does;
* pipeline receives (``P2PCommunicator._communicate``): activations from the previous stage and
  gradients from the next one.

What arrives is deterministic: counts are seeded by ``(step, layer, microbatch, peer)`` and rows
by ``(step, layer, microbatch, peer, direction)``, never by call order, because a recompute
repeats a layer's forward exchange inside its backward. Pipeline receives, which no recompute
repeats, are keyed by their order per direction within a step. ``step`` is the training
iteration the caller names (Megatron's ``args.curr_iteration``), not a count of
forward-backward calls: an overflowing step that is run again (``rerun``, by our runner or by
Megatron-Core's) receives exactly what its first attempt received, and every later step stays
aligned with an unpaged run that never reran. Evaluations are keyed apart from training
(:data:`EVALUATION_STEPS`). Row contents are windows of a
fixed random bank (one gather per exchange), scaled to activation or gradient size.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_paging.tools.peer_load import RouteShape, cap_block

logger = logging.getLogger(__name__)

BANK_ROWS = 4096
# Large odd multipliers: a key's window start in the bank (a hash, not a random draw).
_MIX = np.array([0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1], dtype=np.uint64)
DIRECTIONS = {"dispatch": 1, "probs": 2, "combine": 3, "p2p-forward": 4, "p2p-backward": 5}
# What a received gradient is scaled by (activations come as N(0, 1) rows).
GRAD_SCALE = 1e-3
# Step keys of evaluation calls start here (one per call, in call order): an evaluation at
# iteration N never repeats training step N's exchanges, and training keys never reach it.
EVALUATION_STEPS = 1 << 32


def _graph_task() -> int:
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


@dataclass(frozen=True)
class ExchangeKey:
    """Which forward of which layer an exchange belongs to (carried into its backward)."""

    step: int
    layer: int
    microbatch: int


@dataclass
class PeerStats:
    """Rows the emulated peers sent this rank (live) and rows their budget cut (dropped)."""

    received_rows: int = 0
    dropped_rows: int = 0
    exchanges: int = 0
    per_layer_rows: dict = field(default_factory=lambda: defaultdict(int))


class EmulatedPeers:
    """The EP and PP peers of one emulated rank (module doc).

    Args:
        load: a peer-load model (``LognormalLoad`` or ``TraceLoad``).
        seed: mixed into every row window (counts carry the load model's own seed).
    """

    def __init__(self, load, seed: int = 0):
        self.load = load
        self.seed = int(seed)
        self.step = -1
        self.stats = PeerStats()
        self._forwards: dict[int, int] = defaultdict(int)  # layer -> forwards this step
        self._recomputes: dict[int, deque] = defaultdict(deque)  # layer -> microbatches
        self._p2p: dict[str, int] = defaultdict(int)
        self._banks: dict[tuple, torch.Tensor] = {}
        self._checked = False
        self._evaluations = 0
        self._training_step = -1

    # -- steps -------------------------------------------------------------------------------
    def begin_step(self, step: int | None = None, evaluation: bool = False) -> None:
        """A forward-backward begins: microbatch and receive counters restart.

        ``step``: the training iteration it belongs to; calling again with the same ``step``
        (a rerun) repeats that step's exchanges. None: the step after the previous one (a
        driver without iteration numbers and without reruns). ``evaluation``: a forward-only
        call, keyed from :data:`EVALUATION_STEPS` on by call order.
        """
        if evaluation:
            self.step = EVALUATION_STEPS + self._evaluations
            self._evaluations += 1
        else:
            if step is None:
                step = self._training_step + 1
            if not isinstance(step, int) or not 0 <= step < EVALUATION_STEPS:
                raise ValueError(f"emulated peers: step must be an iteration number in "
                                 f"[0, {EVALUATION_STEPS}), got {step!r}")
            self.step = self._training_step = step
        self._forwards.clear()
        self._recomputes.clear()
        self._p2p.clear()

    def forward_key(self, layer: int) -> ExchangeKey:
        """The key of a layer's forward that starts now: the next microbatch of the layer, or,
        for a recompute inside the backward, the oldest forward not yet recomputed (backward
        runs a chunk's microbatches in forward order)."""
        key = self.next_key(layer)
        if _graph_task() >= 0 and self._recomputes[layer]:
            self._recomputes[layer].popleft()
        else:
            self._forwards[layer] += 1
            self._recomputes[layer].append(key.microbatch)
        return key

    def next_key(self, layer: int) -> ExchangeKey:
        """The key :meth:`forward_key` gives next, without taking it."""
        if self.step < 0:
            self.begin_step()
        if _graph_task() >= 0 and self._recomputes[layer]:
            return ExchangeKey(self.step, layer, self._recomputes[layer][0])
        return ExchangeKey(self.step, layer, self._forwards[layer])

    def largest_sent(self, manager, num_tokens: int) -> int:
        """The most rows one emulated peer wants to send this rank in the layer forward that
        starts next: a dispatcher without a static budget sizes its blocks to the largest pair
        of the group (an all-reduce MAX the fake group cannot make), which includes them."""
        key = self.next_key(manager.layer_number)
        shape = RouteShape(num_tokens, manager.config.moe_router_topk, manager.num_experts,
                           manager.world_size, manager.rank)
        return max((int(np.sum(self.load.rows(shape, key.step, key.layer, key.microbatch, peer)))
                    for peer in range(manager.world_size) if peer != manager.rank), default=0)

    # -- the EP exchange ---------------------------------------------------------------------
    def exchange_counts(self, manager, recv: torch.Tensor, send: torch.Tensor, num_tokens: int
                        ) -> ExchangeKey:
        """The static dispatcher's counts exchange of one layer forward: fills ``recv`` and
        returns the key its row exchanges (and their backward) use."""
        key = self.forward_key(manager.layer_number)
        shape = RouteShape(num_tokens, manager.config.moe_router_topk, manager.num_experts,
                           manager.world_size, manager.rank)
        self.fill_counts(key, recv, send, manager.rank, shape, manager.block_rows)
        return key

    def fill_counts(self, key: ExchangeKey, recv: torch.Tensor, send: torch.Tensor, rank: int,
                    shape: RouteShape, block: int) -> None:
        """``recv[p]``: rows peer ``p`` sends to each local expert (``recv[rank] = send[rank]``)."""
        if not self._checked and hasattr(self.load, "check"):
            self.load.check(shape)
        self._checked = True
        counts = np.zeros(tuple(recv.shape), dtype=np.int64)
        for peer in range(recv.shape[0]):
            if peer == rank:
                continue
            wanted = np.asarray(self.load.rows(shape, key.step, key.layer, key.microbatch, peer))
            kept = cap_block(wanted, block)
            counts[peer] = kept
            self.stats.dropped_rows += int(wanted.sum() - kept.sum())
        received = int(counts.sum())
        self.stats.received_rows += received
        self.stats.per_layer_rows[key.layer] += received
        self.stats.exchanges += 1
        host = torch.from_numpy(counts).to(recv.dtype)
        if recv.is_cuda:
            host = host.pin_memory()
        recv.copy_(host, non_blocking=True)
        recv[rank] = send[rank]

    def fill_rows(self, key: ExchangeKey, direction: str, backward: bool, out: torch.Tensor,
                  inp: torch.Tensor, rank: int, ep: int) -> None:
        """``out`` of an equal-block all-to-all: own block from ``inp``, peers' from the bank
        (written in place: the emulation adds no buffer the real exchange would not have)."""
        width = out.shape[-1] if out.dim() > 1 else 1
        rows = out.numel() // width
        block = rows // ep
        code = DIRECTIONS[direction] * 2 + int(backward)
        starts = self._starts(key.step, key.layer, key.microbatch, np.arange(ep), code)
        bank = self._bank(out.dtype, width, out.device,
                          scale=GRAD_SCALE if backward else 1.0, probs=direction == "probs")
        with torch.no_grad():
            flat = out.view(rows, width)
            torch.index_select(bank, 0, self._index(starts, block, out.device), out=flat)
            flat.view(ep, block, width)[rank].copy_(inp.reshape(ep, block, width)[rank])

    # -- pipeline receives -------------------------------------------------------------------
    def fill_received(self, tensor: torch.Tensor, direction: str) -> None:
        """A pipeline receive: the activation (``p2p-forward``) or gradient (``p2p-backward``)
        a neighbour stage would have sent."""
        if self.step < 0:
            self.begin_step()
        index = self._p2p[direction]
        self._p2p[direction] += 1
        width = tensor.shape[-1]
        rows = tensor.numel() // width
        starts = self._starts(self.step, 0, index, np.zeros(1, dtype=np.int64),
                              DIRECTIONS[direction] * 2)
        bank = self._bank(tensor.dtype, width, tensor.device,
                          scale=GRAD_SCALE if direction == "p2p-backward" else 1.0)
        with torch.no_grad():
            torch.index_select(bank, 0, self._index(starts, rows, tensor.device),
                               out=tensor.view(rows, width))

    # -- row bank ----------------------------------------------------------------------------
    def _starts(self, step, layer, microbatch, peers: np.ndarray, code: int) -> np.ndarray:
        key = np.stack(np.broadcast_arrays(
            np.uint64(self.seed + 1), np.uint64(step + 1), np.uint64(layer + 1),
            np.uint64(microbatch + 1), (peers + 1).astype(np.uint64) * np.uint64(code)), axis=-1)
        with np.errstate(over="ignore"):
            mixed = (key.astype(np.uint64) * _MIX).sum(axis=-1)
            mixed ^= mixed >> np.uint64(29)
        return (mixed % np.uint64(BANK_ROWS)).astype(np.int64)

    @staticmethod
    def _index(starts: np.ndarray, rows: int, device) -> torch.Tensor:
        """Bank rows of each window: ``rows`` consecutive rows from each start, wrapping."""
        first = torch.from_numpy(starts)
        if torch.device(device).type == "cuda":  # no host sync: a pinned, non-blocking copy
            first = first.pin_memory().to(device, non_blocking=True)
        arange = torch.arange(rows, device=device)
        return ((first[:, None] + arange[None, :]) % BANK_ROWS).reshape(-1)

    def _bank(self, dtype, width: int, device, scale: float, probs: bool = False
              ) -> torch.Tensor:
        """``BANK_ROWS`` fixed random rows of ``width`` (normal, or uniform for router probs),
        made once per dtype, width, device and scale."""
        bank_key = (dtype, width, str(device), scale, probs)
        bank = self._banks.get(bank_key)
        if bank is None:
            generator = torch.Generator().manual_seed(self.seed * 7919 + width)
            values = torch.rand if probs else torch.randn
            bank = (values(BANK_ROWS, width, generator=generator) * scale).to(device, dtype)
            self._banks[bank_key] = bank
        return bank


P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
ARGUMENTS_MODULE = "megatron.training.arguments"


def _receiving(communicate, peers: EmulatedPeers):
    """``P2PCommunicator._communicate`` whose received tensors hold what the neighbour stages
    would have sent (the fake group's receive leaves them unwritten)."""

    @functools.wraps(communicate)
    def wrapped(self, *args, **kwargs):
        prev, nxt, reqs = communicate(self, *args, **kwargs)
        for tensor, direction in ((prev, "p2p-forward"), (nxt, "p2p-backward")):
            for t in tensor if isinstance(tensor, (list, tuple)) else (tensor,):
                if t is not None:
                    peers.fill_received(t, direction)
        return prev, nxt, reqs

    return wrapped


def _fake_group_validation(validate_args):
    """Megatron's ``validate_args`` refuses the flex dispatcher under ``--fake-process-group``
    (its HybridEP/DeepEP backends exchange through buffers a fake group cannot fill). Our static
    backend exchanges through the collectives emulated here: validate it as without a fake
    group, then apply what Megatron sets for one (no NaN check, no gloo groups)."""

    @functools.wraps(validate_args)
    def wrapped(args, *rest, **kwargs):
        ours = (getattr(args, "fake_process_group", False)
                and getattr(args, "moe_token_dispatcher_type", None) == "flex"
                and getattr(args, "moe_flex_dispatcher_backend", None) == "static")
        if not ours:
            return validate_args(args, *rest, **kwargs)
        args.fake_process_group = False
        try:
            result = validate_args(args, *rest, **kwargs)
        finally:
            args.fake_process_group = True
        args.check_for_nan_in_loss_and_grad = False  # finiteness is the example's check
        args.use_gloo_process_groups = False
        return result

    return wrapped


def wiring(peers: EmulatedPeers) -> list[tuple[object, str, object]]:
    """``(owner, attribute, replacement)`` for ``install()`` to rebind: where the emulated peers
    write (the static dispatcher's exchanges, pipeline receives) and Megatron's refusal of the
    flex dispatcher under a fake group, lifted for the static backend only."""
    import importlib

    from megatron_paging.mcore.dispatcher import StaticCapacityManager

    p2p = importlib.import_module(P2P_MODULE).P2PCommunicator
    arguments = importlib.import_module(ARGUMENTS_MODULE)
    return [
        (StaticCapacityManager, "peers", peers),
        (p2p, "_communicate", _receiving(p2p._communicate, peers)),
        (arguments, "validate_args", _fake_group_validation(arguments.validate_args)),
    ]


__all__ = ["BANK_ROWS", "DIRECTIONS", "EVALUATION_STEPS", "EmulatedPeers", "ExchangeKey",
           "PeerStats", "wiring"]
