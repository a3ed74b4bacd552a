"""Megatron-Core 0.19.2's paged-stash API (``moe/paged_stash.py``), translated onto the runtime.

:class:`MCorePagingAPI` holds what Megatron-Core keeps in its ``PagedStashManager`` singleton (the
VP stage, layer and microbatch counters) and one
:class:`~megatron_paging.runtime.context.PagingContext` over one
:class:`~megatron_paging.runtime.engine.PagingEngine`; :func:`megatron_paging.mcore.install`
rebinds Megatron-Core's module-level names to the *bound methods* of one instance, so no module
global holds paging state. Every method accepts exactly Megatron-Core's call signature:

==================================  =========================================================
``paged_stash_group_start(t)``      experts, before the grouped MLP: identity (our stashes do
                                    not block the next layer)
``get_paged_stash_context(...)``    experts: opens the slot ``(vp_stage, layer, microbatch)``
                                    and returns saved-tensor hooks: tensors carrying Megatron-
                                    Core's ``grouped_tensor_scale_inv`` mark are paged (``True``:
                                    MXFP8 column-wise scale rows, ``capacity / 32`` rows with
                                    ``live / 32`` live), everything else is saved as usual
``paged_stash_group_commit(t)``     experts, after the grouped MLP: the context's group commit
                                    (forward: stash; backward: reload + prefetch)
``paged_stash_init_chunk_handler``  GPT / hybrid model forward: new microbatch of a VP chunk
``paged_stash_reset(enabled, cfg)`` schedules, start of forward-backward: the engine's
                                    ``begin_step`` (``enabled=False``: forward-only, no paging)
``check_paged_stash_overflow()``    the sticky device flags, as bool tensors ``[1]``
``check_paged_stash_host_spill()``
==================================  =========================================================

plus :meth:`MCorePagingAPI.paged_stash_finish`, the end of a forward-backward, which Megatron-
Core 0.19.2 has no hook for: ``install()`` calls it after every ``forward_backward_func`` (inside
a full-iteration CUDA-graph capture, where it joins the paging stream into the capture).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine

logger = logging.getLogger(__name__)

# Megatron-Core pages MXFP8 column-wise scale rows at 1/32 of the token rows.
SCALE_INV_BLOCK_SIZE = 32
# TransformerConfig field -> PagingConfig field (the per-step settings Megatron-Core passes).
CONFIG_FIELDS = {
    "moe_paged_stash_page_size": "page_size",
    "moe_paged_stash_buffer_size_factor_cuda": "cuda_factor",
    "moe_paged_stash_buffer_size_factor_cpu": "host_factor",
}


class _Group:
    """One grouped-MLP call's paging inputs: capacity, its private live count, the hint."""

    __slots__ = ("capacity_rows", "live_rows", "avg_rows", "name", "_scale_live_rows")

    def __init__(self, capacity_rows, live_rows, avg_rows, name):
        self.capacity_rows = capacity_rows
        self.live_rows = live_rows  # int64 [1], a copy nobody writes, shared by the records
        self.avg_rows = avg_rows
        self.name = name
        self._scale_live_rows = None

    def rows(self, columnwise_scale: bool):
        """(capacity rows, live rows, average hint) of a record, or of its scale rows."""
        if not columnwise_scale:
            return self.capacity_rows, self.live_rows, self.avg_rows
        if self._scale_live_rows is None:
            self._scale_live_rows = self.live_rows // SCALE_INV_BLOCK_SIZE
        avg = None if self.avg_rows is None else self.avg_rows // SCALE_INV_BLOCK_SIZE
        return self.capacity_rows // SCALE_INV_BLOCK_SIZE, self._scale_live_rows, avg


class MCorePagingAPI:
    """The paged-stash API of Megatron-Core, backed by a paging engine.

    Args:
        engine: the engine that stashes and reloads (default: one with ``config``).
        config: the run's paging options (default: ``PagingConfig.from_env()``); Megatron-Core's
            page size and buffer factors from ``paged_stash_reset``'s config override them.
        device: where the "nothing to report" flags live before any pool exists (default: the
            current CUDA device, else CPU).
    """

    def __init__(self, engine: PagingEngine | None = None, config: PagingConfig | None = None,
                 device: torch.device | None = None):
        if engine is None:
            engine = PagingEngine(PagingConfig.from_env() if config is None else config)
        self.engine = engine
        self.context = PagingContext(engine)
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.enabled = False
        self.vp_size = 1
        self.vp_stage = 0
        self._layer: list[int] = [0]
        self._microbatch: list[int] = [0]
        self._group: _Group | None = None
        self.iteration = 0
        self.offload = None  # the paged offloading backend's manager, when install() made one

    # -- experts.py ------------------------------------------------------------------------
    def paged_stash_group_start(self, tensor):
        """Mark the start of a layer group (identity: nothing to wait for). Its backward, once
        the group's backward is done, prefetches the groups below (the slot-end rule)."""
        return self.context.slot_end_marker(tensor, *self._slot())

    def _slot(self) -> tuple[int, int, int]:
        """``(vp_stage, layer, microbatch)`` of the slot the running layer opens."""
        stage = self.vp_stage
        return stage, self._layer[stage], self._microbatch[stage]

    def get_paged_stash_context(
        self, name=None, max_num_tokens=None, num_tokens_tensor=None, avg_num_tokens=None
    ):
        """The context's saved-tensor hooks with this group's pack policy (:meth:`_pack`: page
        the marked capacity-sized tensors); none for a recompute inside the backward, whose
        tensors are read at once."""
        if not self.context.pages_forward:
            return nullcontext()
        if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int):
            raise TypeError(
                f"get_paged_stash_context: max_num_tokens must be an int, got {max_num_tokens!r}"
            )
        if not isinstance(num_tokens_tensor, torch.Tensor) or num_tokens_tensor.numel() != 1:
            raise TypeError(
                "get_paged_stash_context: num_tokens_tensor must be a one-element tensor, got "
                f"{num_tokens_tensor!r}"
            )
        # One private copy per group, shared read-only by its records: the dispatcher may
        # overwrite its own tensor for the next microbatch before this one is reloaded.
        live = num_tokens_tensor.reshape(1).to(torch.int64, copy=True)
        self._group = _Group(max_num_tokens, live, avg_num_tokens, name)
        self.context.open_slot(*self._slot(), live.device)
        return self.context.hooks(self._pack)

    def _pack(self, tensor):
        """The paged stash's pack policy. Megatron-Core's contract: only tensors its grouped
        MLP marked are paged; every other tensor is kept as it is."""
        if tensor.dim() == 0 or not hasattr(tensor, "grouped_tensor_scale_inv"):
            return tensor
        group = self._group
        rows, live, avg = group.rows(bool(tensor.grouped_tensor_scale_inv))
        if rows <= 0 or tensor.numel() % rows:
            raise ValueError(
                f"paging: saved tensor {tuple(tensor.shape)} {tensor.dtype} is not {rows} "
                f"capacity rows (max_num_tokens={group.capacity_rows})"
            )
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        notes = {"name": group.name, "avg_rows": avg}
        return self.context.pack_marked(tensor, live, rows, notes, private=True)

    def paged_stash_group_commit(self, tensor, name=None):
        """Mark the end of a layer group: stash it now, reload it when backward reaches it."""
        if not self.context.pages_forward:  # a recompute leaves the layer count alone
            return tensor
        self._layer[self.vp_stage] += 1
        if self._group is None:
            return tensor
        self._group = None
        return self.context.group_commit(tensor)

    # -- gpt_model.py / hybrid_model.py ----------------------------------------------------
    def paged_stash_init_chunk_handler(self, vp_size, vp_stage):
        """A model chunk starts the forward of its next microbatch."""
        vp_size = 1 if vp_size is None else int(vp_size)
        vp_stage = 0 if vp_stage is None else int(vp_stage)
        if vp_size != self.vp_size or len(self._layer) != vp_size:
            self.vp_size = vp_size
            self._layer = [0] * vp_size
            self._microbatch = [0] * vp_size
        self.vp_stage = vp_stage
        self._layer[vp_stage] = 0
        self._microbatch[vp_stage] += 1

    # -- schedules.py ----------------------------------------------------------------------
    def paged_stash_reset(self, enabled=True, config=None):
        """Start of a forward-backward: calibrate, or reset rings and flags (no allocation)."""
        self.enabled = bool(enabled)
        self.iteration += 1
        self._layer = [0] * self.vp_size
        self._microbatch = [0] * self.vp_size
        self._group = None
        if config is not None and self.enabled:
            self._sync_config(config)
        self.context.begin_step(self.enabled)

    def paged_stash_finish(self):
        """End of a forward-backward: join the paging stream; after calibration, size pools."""
        self._group = None
        return self.context.finish()

    def _sync_config(self, config) -> None:
        current = self.engine.config
        changes = {
            ours: getattr(config, theirs)
            for theirs, ours in CONFIG_FIELDS.items()
            if hasattr(config, theirs) and getattr(config, theirs) != getattr(current, ours)
        }
        if changes:
            self.engine.configure(current.replace(**changes))

    # -- training.py (through PagedStashRunner) --------------------------------------------
    def check_paged_stash_overflow(self):
        """Device bool ``[1]``: a stash found no room (the step's activations are garbage)."""
        flags = self.engine.flags
        if not self.enabled or flags is None:
            return torch.zeros(1, dtype=torch.bool, device=self.device)
        return flags.overflow.ne(0)

    def check_paged_stash_host_spill(self):
        """Device bool ``[1]``: some record went to the pinned host tier."""
        flags = self.engine.flags
        if not self.enabled or flags is None:
            return torch.zeros(1, dtype=torch.bool, device=self.device)
        return flags.host_spill.ne(0)

    def functions(self) -> dict:
        """Megatron-Core name -> our bound method, for the installer."""
        return {name: getattr(self, name) for name in API_FUNCTION_NAMES}


API_FUNCTION_NAMES = (
    "paged_stash_group_start",
    "get_paged_stash_context",
    "paged_stash_group_commit",
    "paged_stash_init_chunk_handler",
    "paged_stash_reset",
    "check_paged_stash_overflow",
    "check_paged_stash_host_spill",
)

__all__ = ["API_FUNCTION_NAMES", "CONFIG_FIELDS", "MCorePagingAPI", "SCALE_INV_BLOCK_SIZE"]
