"""The running backward op and the weight gradients it defers to a later W op.

:class:`~megatron_paging.runtime.context.PagingContext` keeps one :class:`DeferredWgrads`: inside
``context.backward(chunk, microbatch, defer_wgrad=True)`` a custom autograd function hands its
weight-gradient closure to ``context.defer_wgrad(fn)``; ``context.run_wgrad(chunk,
microbatch)`` (the W op) runs them in the order they were deferred, opening each slot's wgrad
branch in the scheduler first (its ``wgrad_only`` records stayed paged until then).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackwardOp:
    """The backward of ``chunk`` for ``microbatch`` that is running now."""

    chunk: int
    microbatch: int
    defer_wgrad: bool


@dataclass(frozen=True)
class DeferredWgrad:
    """A weight-gradient closure and the slot (layer) whose backward deferred it."""

    layer: Any  # None: deferred outside any slot's backward
    fn: Callable[[], None]


class DeferredWgrads:
    """The running backward op, the slot whose backward runs in it, and the deferred wgrads
    per ``(chunk, microbatch)``."""

    def __init__(self):
        self.running: BackwardOp | None = None
        self.layer: Any = None  # the slot whose backward began last in the running op
        self._deferred: dict[tuple[int, int], list[DeferredWgrad]] = defaultdict(list)

    @contextlib.contextmanager
    def backward(self, chunk: int, microbatch: int, defer_wgrad: bool):
        self.running = BackwardOp(int(chunk), int(microbatch), bool(defer_wgrad))
        try:
            yield
        finally:
            self.running = None
            self.layer = None

    @property
    def deferring(self) -> bool:
        """Whether the running backward defers weight gradients."""
        return self.running is not None and self.running.defer_wgrad

    def defers(self, chunk: int, microbatch: int) -> bool:
        """Whether the running backward is ``(chunk, microbatch)``'s and defers wgrads."""
        running = self.running
        return (running is not None and running.defer_wgrad
                and (running.chunk, running.microbatch) == (chunk, microbatch))

    def defer(self, fn: Callable[[], None]) -> None:
        if not self.deferring:
            raise RuntimeError("defer_wgrad() outside a backward(..., defer_wgrad=True)")
        running = self.running
        self._deferred[(running.chunk, running.microbatch)].append(DeferredWgrad(self.layer, fn))

    def take(self, chunk: int, microbatch: int) -> list[DeferredWgrad]:
        """The wgrads ``(chunk, microbatch)``'s backward deferred, in order; forgets them."""
        return self._deferred.pop((int(chunk), int(microbatch)), [])

    def pending(self) -> list[tuple[int, int]]:
        """The ``(chunk, microbatch)`` pairs whose deferred wgrads have not run, sorted."""
        return sorted(self._deferred)

    def clear(self) -> None:
        self._deferred.clear()


__all__ = ["BackwardOp", "DeferredWgrad", "DeferredWgrads"]
