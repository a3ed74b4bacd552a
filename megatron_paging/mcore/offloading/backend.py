"""The paged backend of Megatron-Core's fine-grained activation offloading.

Megatron-Core 0.19.2's modules offload through ``FineGrainedActivationOffloadingInterface``
(``off_interface``): ``with off_interface(flag, x, name) as x: ...`` around the ops whose saved
tensors go to the host, ``y = manager.group_offload(y, forced_released_tensors=[...])`` when
the group's forward is done, ``init_chunk_handler`` per model chunk forward,
``mark_not_offload``, and ``reset`` after each forward-backward. With
``--paging-offload-backend paged``, :func:`megatron_paging.mcore.install` rebinds that class
everywhere to :func:`make_interface`'s class over one :class:`PagedOffloadManager`, which
translates it onto the paging runtime (the same engine, scheduler and paging stream as the paged
stash):

* a group is an *offload group* slot ``(vp stage, ("offload", index, name), microbatch)`` of
  the step's scheduler (it nests inside an open paged-stash slot: ``expert_fc1`` and ``moe_act``
  run inside the experts' stash context); its commit stashes on the paging stream, its backward
  reloads it (FIFO, prefetch of the next groups below, late wait at unpack) like a stashed layer;
* what a group's ops save for backward goes through the runtime's one saved-tensor hook
  (``PagingContext.hooks``) with the group's pack policy (:meth:`PagedOffloadManager.pack`): a
  tensor carrying :data:`LIVE_ROWS_ATTR` (set by
  :class:`~megatron_paging.mcore.experts.PagedGroupedMLP` on its capacity buffers) is offloaded as
  its live rows only, through the page-tile kernels into the host tier; any other CUDA tensor of
  at least ``--min-offloaded-tensor-size`` elements goes whole (one DMA copy into the pinned
  arena; a non-contiguous view comes back at its strides); parameters, tensors marked
  ``_do_not_offload`` and small tensors stay;
* ``forced_released_tensors`` are released (storage resized to 0) only if this group offloaded
  their storage: eagerly at once with ``record_stream`` on the paging stream, inside a CUDA-graph
  capture when the compute stream has waited on the copy (``SourceLifetimes``);
* which groups offload after the calibration step: :mod:`.groups` (Megatron-Core's margin,
  ``--delta-offload-bytes-across-pp-ranks`` and ``--activation-offload-fraction``).

Without ``--moe-paged-stash`` the schedules never begin a paging step, so the manager begins it
at the first ``init_chunk_handler`` of a forward-backward (``install()`` ends every
forward-backward, as for the paged stash).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from megatron_paging.mcore.offloading.groups import GroupLog, OffloadPlan, plan_from_log
from megatron_paging.runtime.engine import CALIBRATE
from megatron_paging.runtime.saved import packable

logger = logging.getLogger(__name__)

# A capacity buffer whose first rows are live: ``tensor.paging_live_rows = (live_rows int64 [1]
# on the device, nobody writes it before the reload)``. Its rows are offloaded, not the tensor.
LIVE_ROWS_ATTR = "paging_live_rows"
EXPERT_MODULES = ("expert_fc1", "moe_act")
DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


def _offloadable(tensor, min_numel: int, device_type: str) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == device_type  # the run's device (CUDA; CPU in CPU tests)
        and not isinstance(tensor, torch.nn.Parameter)
        and type(tensor) is torch.Tensor  # no fake / functional / quantized subclasses
        and tensor.numel() >= max(1, min_numel)
        and not getattr(tensor, "_do_not_offload", False)
        and not getattr(tensor, "_TE_do_not_offload", False)
    )


class _Group:
    """One open offload group: the interface instance's state between enter and commit."""

    __slots__ = ("cm", "index", "name", "key", "packed", "kept", "above_offloaded", "counted")

    def __init__(self, cm, index, name, kept=False, above_offloaded=False):
        self.cm, self.index, self.name = cm, index, name
        self.key = ("offload", index, name)  # its slot's layer key in the scheduler
        self.kept = kept  # the plan keeps it on the device: its tensors are saved as they are
        # kept, and the group before it in this chunk-microbatch's forward was offloaded: its
        # backward is where the reloads below a run of kept groups begin (kept_group_done)
        self.above_offloaded = above_offloaded
        # (storage pointer of the tensor autograd saved, what pack returned for it)
        self.packed: list[tuple[int, object]] = []
        # (address, bytes) of the tensors counted in the report: a tensor saved twice in the
        # group is one copy. Per group, because a later group may reuse a freed address.
        self.counted: set[tuple[int, int]] = set()

    def copy_streams(self) -> list:
        """The streams this group's copies ran on (the paging stream, offload streams)."""
        streams = []
        for _, saved in self.packed:
            stream = getattr(getattr(saved, "handle", None), "copy_stream", None)
            if stream is not None and not any(s == stream for s in streams):
                streams.append(stream)
        return streams

    def releasable_storages(self) -> set[int]:
        """Storages whose every saved tensor of this group was copied away at the commit (not
        parked, declined or kept): Megatron's ``forced_released_tensors`` of those may go."""
        moved: dict[int, bool] = {}
        for pointer, saved in self.packed:
            handle = getattr(saved, "handle", None)
            ok = handle is not None and handle.tensor is None and handle.parked is None
            moved[pointer] = moved.get(pointer, True) and ok
        return {pointer for pointer, ok in moved.items() if ok}


class PagedOffloadManager:
    """Megatron-Core's ``PipelineOffloadManager``, translated onto a :class:`MCorePagingAPI`."""

    def __init__(self, api):
        self.api = api
        self.context = api.context
        self.enabled = True  # Megatron's disable_offload / enable_offload
        self.min_numel = 1024 * 1024
        self.pp_rank, self.delta_bytes, self.fraction = 0, 0, 1.0
        self.plan: OffloadPlan | None = None
        self.log: GroupLog | None = None  # the calibration step's, until the plan is made
        self._iteration = None
        self._stage = 0
        self._microbatch: dict[int, int] = {}
        self._index: dict[tuple[int, int], int] = {}
        # Bytes the last step's groups offloaded, by kind (live-row buffers at their capacity:
        # what Megatron-Core's offloading would move; ours moves only their live rows, whose
        # device counts and row bytes _live_rows keeps for rows_live_bytes).
        self.offloaded_bytes = {"rows_capacity": 0, "whole": 0}
        self._live_rows: list[tuple[torch.Tensor, int]] = []
        self.cuda_graph_stream = None
        self.cuda_graph_event = None

    # -- model forward: gpt_model / hybrid_model ---------------------------------------------
    def init_chunk_handler(self, pp_rank=0, vp_size=None, vp_stage=None,
                           min_offloaded_tensor_size=1024 * 1024,
                           delta_offload_bytes_across_pp_ranks=0,
                           activation_offload_fraction=1.0, max_inflight_offloads=None):
        """A model chunk starts the forward of its next microbatch."""
        engine = self.api.engine
        if not engine.step_open:  # no --moe-paged-stash: the schedules began no step
            self.api.paged_stash_reset(enabled=torch.is_grad_enabled())
        if self._iteration != self.api.iteration:  # a new forward-backward
            self._iteration = self.api.iteration
            self._microbatch.clear()
            self._index.clear()
            self.offloaded_bytes = {"rows_capacity": 0, "whole": 0}
            self._live_rows = []
            self._close_calibration()
        self.min_numel = int(min_offloaded_tensor_size)
        self.pp_rank = int(pp_rank)
        self.delta_bytes = int(delta_offload_bytes_across_pp_ranks)
        self.fraction = float(activation_offload_fraction)
        self._stage = 0 if vp_stage is None else int(vp_stage)
        self._microbatch[self._stage] = self._microbatch.get(self._stage, 0) + 1

    def _close_calibration(self) -> None:
        if self.log is not None and self.api.engine.mode != CALIBRATE:
            self.plan = plan_from_log(self.log, self.pp_rank, self.delta_bytes, self.fraction)
            kept = len(self.plan.kept)
            total = sum(len(g) for g in self.log.groups.values())
            logger.info(
                "paging offload: %d of %d groups per step offloaded (%d kept on the device by "
                "the margin, --delta-offload-bytes-across-pp-ranks and "
                "--activation-offload-fraction)", total - kept, total, kept,
            )
            self.log = None
        if self.api.engine.mode == CALIBRATE:
            self.log = GroupLog()

    # -- a module's group --------------------------------------------------------------------
    def group_start(self, name: str, tensor: torch.Tensor):
        """Open the next group of the running chunk-microbatch; None when it stays on device."""
        # (not in a recompute inside the backward: its tensors are read at once)
        if not (self.enabled and self.context.pages_forward and torch.is_grad_enabled()):
            return None
        cm = (self._stage, self._microbatch.get(self._stage, 0))
        index = self._index[cm] = self._index.get(cm, -1) + 1
        if self.log is not None:
            self.log.forward_group(cm, index, name)
        elif self.plan is not None and not self.plan.offloads(cm, index):
            # Saved as they are, even inside a paged-stash slot: "not offloaded" means what it
            # means for Megatron-Core (and the stash pools were sized without these tensors).
            above = index > 0 and self.plan.offloads(cm, index - 1)
            return _Group(cm, index, name, kept=True, above_offloaded=above)
        group = _Group(cm, index, name)
        self.context.open_offload_group(cm[0], group.key, cm[1], tensor.device)
        return group

    def pack(self, group: _Group, tensor):
        """The group's pack policy (:meth:`PagingContext.hooks`): what autograd keeps for
        ``tensor``. Kept as it is: everything of a kept group, parameters, small or marked
        tensors, overlapping views; offloaded by the context otherwise: the live rows of a
        buffer carrying :data:`LIVE_ROWS_ATTR`, any other tensor whole (a non-contiguous view
        comes back at its strides)."""
        if group.kept or not _offloadable(tensor, self.min_numel, self.api.device.type):
            return tensor
        live = getattr(tensor, LIVE_ROWS_ATTR, None)
        pointer = tensor.untyped_storage().data_ptr()
        movable = packable(tensor, rows=live is not None)
        if movable is None:
            return tensor  # overlapping or a strided capacity buffer: saved as it is
        tensor, view = movable
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.data_ptr(), nbytes) not in group.counted:
            group.counted.add((tensor.data_ptr(), nbytes))
            self.offloaded_bytes["rows_capacity" if live is not None else "whole"] += nbytes
            if live is not None:
                self._live_rows.append((live, nbytes // max(1, tensor.shape[0])))
        if self.log is not None:
            self.log.add_bytes(group.cm, group.index, nbytes)
        if live is not None:
            saved = self.context.pack_offload(tensor, live, tensor.shape[0], view)
        else:
            saved = self.context.pack_offload(tensor, view=view)
        group.packed.append((pointer, saved))
        return saved

    def rows_live_bytes(self) -> int:
        """Live-row bytes the last step offloaded. Reads the device counts (a host sync): for
        reports after training, never inside a step. Under graphs the counts are the last
        replay's (a replay rewrites the captured step's count tensors)."""
        return sum(int(live.sum()) * row_bytes for live, row_bytes in self._live_rows)

    def group_commit(self, group: _Group, tensor, forced_released_tensors):
        """End of the group's forward: offload it; its backward reloads it."""
        key = (group.cm[0], group.key, group.cm[1])
        innermost = self.context.innermost_slot
        if innermost != key:  # Megatron's groups close innermost first
            raise RuntimeError(
                f"paging offload: group {group.name!r} committed while slot {innermost} is the "
                "innermost open one"
            )
        tensor = self.context.group_commit(tensor)
        scheduler = self.context.scheduler
        if not forced_released_tensors or scheduler is None:
            return tensor
        releasable = group.releasable_storages()
        forced = [t for t in forced_released_tensors if isinstance(t, torch.Tensor)
                  and t.untyped_storage().data_ptr() in releasable]
        backend = scheduler.backend
        if backend.capturing():
            # No stream may be told to keep it: freed once the compute stream waited on its copy.
            scheduler.sources.free_with_sources(forced)
            return tensor
        streams = group.copy_streams() or [backend.paging_stream]
        for t in forced:
            for stream in streams:  # reuse waits for the copies
                backend.keep_alive(t, stream)
            t.untyped_storage().resize_(0)
        return tensor

    def kept_group_done(self, group: _Group, tensor):
        """A group the plan keeps on the device ended its forward (the margin's last layer):
        the forward's offload copies of that module name in flight need not stay in flight.

        Returns ``tensor``, through :class:`_OnBackward` calling :meth:`kept_backward` when the
        group sits right above an offloaded one: no offloaded group's backward comes before that
        one's, so without this its reload would start only when its own backward does and the
        compute stream would wait for the whole PCIe copy. This group's backward begins once the
        kept groups above it are done with their saved tensors, so the reload takes memory they
        gave back — not the memory of their backward, where the step peaks (a prefetch from the
        first kept group's backward would add the reload to that peak).
        """
        scheduler = self.context.scheduler
        if scheduler is not None:
            scheduler.sources.close_offload_window(group.cm[0], group.name, group.cm[1])
        if not (group.above_offloaded and scheduler is not None
                and isinstance(tensor, torch.Tensor) and tensor.requires_grad
                and torch.is_grad_enabled()):
            return tensor
        return _OnBackward.apply(tensor, self.kept_backward, group)

    def kept_backward(self, group: _Group) -> None:
        """The backward of a kept group right above an offloaded one began: reload the
        ``prefetch_distance`` offloaded groups below it (its chunk-microbatch's top ones now)."""
        scheduler = self.context.scheduler
        if scheduler is not None:
            scheduler.prefetch(group.cm[0], group.cm[1])

    def backward_started(self, group: _Group) -> None:
        if self.log is not None:
            self.log.backward_group(group.cm)

    # -- schedules and the rest of Megatron's interface --------------------------------------
    def reset(self) -> None:
        """After a forward-backward (``install()`` has ended the paging step already)."""

    def mark_not_offload(self, tensor) -> None:
        if tensor is not None:
            tensor._do_not_offload = True


class _OnBackward(torch.autograd.Function):
    """Identity on a group's output whose backward calls ``callback(group)``: it runs first in
    that group's backward (the calibration log's backward start, a kept group's prefetch)."""

    @staticmethod
    def forward(ctx, tensor, callback, group):
        ctx.callback, ctx.group = callback, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback(ctx.group)
        return grad, None, None


def make_interface(manager: PagedOffloadManager) -> type:
    """A class with ``FineGrainedActivationOffloadingInterface``'s signatures, bound to
    ``manager`` (no module global holds it)."""

    class PagedOffloadInterface:
        """``FineGrainedActivationOffloadingInterface`` over the paging runtime."""

        def __init__(self, offload: bool, tensor: torch.Tensor, name: str):
            self.offload, self.tensor, self.name = offload, tensor, name
            self._group = None
            self._hooks = None

        def __enter__(self):
            if self.offload:
                self._group = manager.group_start(self.name, self.tensor)
            if self._group is not None:  # the runtime's hook, with the group's pack policy
                self._hooks = manager.context.hooks(functools.partial(manager.pack, self._group))
                self._hooks.__enter__()
            return self.tensor

        def __exit__(self, *exc):
            if self._hooks is not None:
                self._hooks.__exit__(*exc)
                self._hooks = None

        def group_offload(self, tensor, forced_released_tensors=None, delay_offload=False):
            group, self._group = self._group, None
            if group is None:
                return tensor
            if group.kept:  # Megatron's rule: the first output carries the group's boundary
                if isinstance(tensor, (tuple, list)) and tensor:
                    first = manager.kept_group_done(group, tensor[0])
                    return type(tensor)([first, *tensor[1:]])
                return manager.kept_group_done(group, tensor)
            if isinstance(tensor, (tuple, list)):  # Megatron's rule: the first output carries it
                if not tensor:
                    manager.context.commit_slot()
                    return tensor
                first = self._commit(group, tensor[0], forced_released_tensors)
                return type(tensor)([first, *tensor[1:]])
            return self._commit(group, tensor, forced_released_tensors)

        @staticmethod
        def _commit(group, tensor, forced_released_tensors):
            tensor = manager.group_commit(group, tensor, forced_released_tensors or [])
            if manager.log is not None and torch.is_grad_enabled() and tensor.requires_grad:
                tensor = _OnBackward.apply(tensor, manager.backward_started, group)
            return tensor

        @staticmethod
        def init_chunk_handler(pp_rank, vp_size, vp_stage, min_offloaded_tensor_size,
                               delta_offload_bytes_across_pp_ranks, activation_offload_fraction,
                               max_inflight_offloads=None):
            manager.init_chunk_handler(
                pp_rank, vp_size, vp_stage, min_offloaded_tensor_size,
                delta_offload_bytes_across_pp_ranks, activation_offload_fraction,
                max_inflight_offloads,
            )

        @staticmethod
        def mark_not_offload(tensor):
            manager.mark_not_offload(tensor)

        @staticmethod
        def reset():
            manager.reset()

        @staticmethod
        def reset_instance():
            manager.reset()

        @staticmethod
        def disable_offload():
            manager.enabled = False

        @staticmethod
        def enable_offload():
            manager.enabled = True

        # Per-layer CUDA-graph paths: refused at start-up with this backend (mcore/flags.py);
        # kept callable so nothing else in Megatron breaks on the name.
        @staticmethod
        def get_context(flag):
            return contextlib.nullcontext()

        @staticmethod
        def forward_record():
            pass

        @staticmethod
        def backward_record(tensor):
            return tensor

        @staticmethod
        def flush_delayed_groups():
            pass

        @staticmethod
        def enter_replay():
            pass

        @staticmethod
        def exit_replay():
            pass

        @staticmethod
        def cuda_graph_stream():
            return manager.cuda_graph_stream

        @staticmethod
        def cuda_graph_event():
            return manager.cuda_graph_event

    PagedOffloadInterface.manager = manager
    return PagedOffloadInterface


__all__ = [
    "DENSE_MODULES",
    "EXPERT_MODULES",
    "LIVE_ROWS_ATTR",
    "PagedOffloadManager",
    "make_interface",
]
