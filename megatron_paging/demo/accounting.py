"""The demo's byte accounting (the table and the plot): what each run holds for backward.

It reads pool counters on the host after every layer forward and backward (on CUDA after a
device synchronize), which serializes the paging stream: demo instrumentation, not part of
paging and not for benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.tools.pipeline_sim import LayerEvent

Slot = tuple[int, int, int]  # (chunk, layer, microbatch)


@dataclass(frozen=True)
class Held:
    """Bytes held for backward at one moment, and the pool pages they take (0: no pools)."""

    bytes: int
    pages: int = 0


class MarkLedger:
    """The layers' ``paging`` argument: passes marks on to the context and keeps, per layer
    forward, the bytes of the capacity buffers it marked — what an unpaged run holds for them
    until that layer's backward."""

    def __init__(self, context: PagingContext):
        self.context = context
        self.held_bytes = 0
        self._open = 0
        self._held: dict[Slot, int] = {}

    def mark(self, tensor, live_rows, segments=None):
        self._open += tensor.numel() * tensor.element_size()
        return self.context.mark(tensor, live_rows, segments)

    def note(self, event: LayerEvent) -> None:
        """A layer's forward keeps what it marked until that layer's backward frees it."""
        slot = (event.chunk, event.layer, event.microbatch)
        if event.kind == "F":
            self._held[slot], self._open = self._open, 0
            self.held_bytes += self._held[slot]
        else:
            self.held_bytes -= self._held.pop(slot)


def unpaged_held(ledger: MarkLedger) -> Held:
    """What an unpaged run holds: every marked buffer until its layer's backward."""
    return Held(ledger.held_bytes)


def pool_usage(pools: PagePools) -> Held:
    """Pool pages in use, both tiers (host read of the ring counters)."""
    if pools.device.type == "cuda":
        torch.cuda.synchronize(pools.device)  # let the paging stream's copies land first
    used_bytes = used_pages = 0
    for pool in pools:
        free_device, free_host = pool.free_pages()
        pages = pool.num_cuda_pages - free_device + pool.num_host_pages - free_host
        used_pages += pages
        used_bytes += pages * pool.page_bytes
    return Held(used_bytes, used_pages)


class SpillCountingBackend:
    """A stream backend wrapper that counts the stashes the pinned-host tier took."""

    def __init__(self, inner):
        self.inner = inner
        self.host_spills = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, stream, kind: str, fn: Callable[[], None], **info) -> None:
        pool = info.get("pool")
        if kind != "stash" or pool is None or not pool.has_host_tier:
            return self.inner.launch(stream, kind, fn, **info)
        before = _host_free_pages(pool)
        self.inner.launch(stream, kind, fn, **info)
        self.host_spills += _host_free_pages(pool) < before


def _host_free_pages(pool) -> int:
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)  # the paging stream may still be writing
    return pool.free_pages()[1]


__all__ = ["Held", "MarkLedger", "SpillCountingBackend", "pool_usage", "unpaged_held"]
