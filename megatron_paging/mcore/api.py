"""Our implementation of Megatron-Core 0.19.2's paged-stash API (``moe/paged_stash.py``).

:class:`MCorePagingAPI` holds the state Megatron-Core keeps in its ``PagedStashManager``
singleton; :func:`megatron_paging.mcore.install.install` rebinds Megatron-Core's module-level
names to the *bound methods* of one instance, so no module global holds paging state. Every
method accepts exactly Megatron-Core's call signature:

==================================  =========================================================
``paged_stash_group_start(t)``      experts, before the grouped MLP: identity (our stashes do
                                    not block the next layer; sources are freed through the
                                    allocator once their stash finished)
``get_paged_stash_context(...)``    experts: saved-tensor hooks for the grouped MLP; tensors
                                    carrying Megatron-Core's ``grouped_tensor_scale_inv`` mark
                                    are paged, everything else is saved as usual
``paged_stash_group_commit(t)``     experts, after the grouped MLP: forward = stash the group;
                                    backward = reload it (plus prefetch)
``paged_stash_init_chunk_handler``  GPT / hybrid model forward: new microbatch of a VP chunk
``paged_stash_reset(enabled, cfg)`` schedules, start of forward-backward: calibrate / size /
                                    reset pools; ``enabled=False`` (forward-only) pages nothing
``check_paged_stash_overflow()``    the sticky device flags, as bool tensors ``[1]``
``check_paged_stash_host_spill()``
==================================  =========================================================
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from megatron_paging.mcore.engine import PagedGroup, PagingEngine

logger = logging.getLogger(__name__)


class _GroupCommit(torch.autograd.Function):
    """Identity whose forward stashes a group and whose backward reloads it."""

    @staticmethod
    def forward(ctx, tensor, engine, group):
        ctx.engine, ctx.group = engine, group
        engine.commit(group)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.engine.reload(ctx.group)
        ctx.group = None  # the graph may outlive this backward; the group is done
        return grad, None, None


class MCorePagingAPI:
    """The paged-stash API of Megatron-Core, backed by a paging engine.

    Args:
        engine: the engine that stashes and reloads (default: :class:`PagingEngine`).
        device: where the "nothing to report" flags live before any pool exists (default: the
            current CUDA device, else CPU).
    """

    def __init__(self, engine: PagingEngine | None = None, device: torch.device | None = None):
        self.engine = engine if engine is not None else PagingEngine()
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.enabled = False
        self.vp_size = 1
        self.vp_stage = 0
        self._layer: list[int] = [0]
        self._microbatch: list[int] = [0]
        self._open_group: PagedGroup | None = None
        self.iteration = 0

    # -- experts.py ------------------------------------------------------------------------
    def paged_stash_group_start(self, tensor):
        """Mark the start of a layer group (identity: nothing to wait for)."""
        return tensor

    def get_paged_stash_context(
        self, name=None, max_num_tokens=None, num_tokens_tensor=None, avg_num_tokens=None
    ):
        """Saved-tensor hooks that page the group's marked capacity-sized tensors."""
        if not self.enabled:
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
        annotations = {
            "name": name,
            "vp_stage": self.vp_stage,
            "layer": self._layer[self.vp_stage],
            "microbatch": self._microbatch[self.vp_stage],
            "avg_num_tokens": avg_num_tokens,
        }
        group = self.engine.open_group(max_num_tokens, num_tokens_tensor, annotations)
        self._open_group = group

        def pack(tensor):
            # Megatron-Core's contract: only tensors its grouped MLP marked are paged.
            if tensor.dim() == 0 or not hasattr(tensor, "grouped_tensor_scale_inv"):
                return tensor
            return self.engine.pack(group, tensor, bool(tensor.grouped_tensor_scale_inv))

        return torch.autograd.graph.saved_tensors_hooks(pack, self.engine.unpack)

    def paged_stash_group_commit(self, tensor, name=None):
        """Mark the end of a layer group: stash it now, reload it when backward reaches it."""
        if not self.enabled:
            return tensor
        group, self._open_group = self._open_group, None
        self._layer[self.vp_stage] += 1
        if group is None:
            return tensor
        if not torch.is_grad_enabled() or not tensor.requires_grad:
            self.engine.commit(group)
            return tensor
        return _GroupCommit.apply(tensor, self.engine, group)

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
        """Start of a forward-backward: calibrate, size the pools, or reset rings and flags."""
        self.enabled = bool(enabled)
        self.iteration += 1
        self._layer = [0] * self.vp_size
        self._microbatch = [0] * self.vp_size
        self._open_group = None
        page_size = getattr(config, "moe_paged_stash_page_size", 64)
        cuda_factor = getattr(config, "moe_paged_stash_buffer_size_factor_cuda", 1.10)
        host_factor = getattr(config, "moe_paged_stash_buffer_size_factor_cpu", 0.0)
        self.engine.begin_step(self.enabled, page_size, cuda_factor, host_factor)

    # -- training.py (through PagedStashRunner) --------------------------------------------
    def check_paged_stash_overflow(self):
        """Device bool ``[1]``: a stash found no room (the step's activations are garbage)."""
        flag = self.engine.overflow
        if not self.enabled or flag is None:
            return torch.zeros(1, dtype=torch.bool, device=self.device)
        return flag.ne(0)

    def check_paged_stash_host_spill(self):
        """Device bool ``[1]``: some record went to the pinned host tier."""
        flag = self.engine.host_spill
        if not self.enabled or flag is None:
            return torch.zeros(1, dtype=torch.bool, device=self.device)
        return flag.ne(0)

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

__all__ = ["API_FUNCTION_NAMES", "MCorePagingAPI"]
