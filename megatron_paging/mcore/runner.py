"""The training-step runner that replaces Megatron-Core 0.19.2's ``PagedStashRunner``.

Same constructor and call signature as ``megatron.core.transformer.moe.paged_stash
.PagedStashRunner``; ``install()`` rebinds ``megatron.training.training.PagedStashRunner`` to
this class (bound to the paging API through the ``paging`` keyword). What changes:

* One collective per step: paging overflow, host spill, invalid live counts and the dispatchers'
  over-budget flags are packed in one tensor and all-reduced together, with no host read.
* The overflow handling is :class:`~megatron_paging.overflow.monitor.OverflowMonitor` (the one
  the demo drives too) with the policy of the engine's config (``--paging-overflow-policy``);
  this runner adds what is Megatron's:

  - 'rerun' reads the flags right after forward-backward and repeats the step before the
    optimizer consumes the gradients (one host read per step, as in Megatron-Core): paged, in
    pools grown to what the step needed, when pools fell short; without the static budget, paged
    through the pools as they are, when a dispatcher was over it (Megatron-Core reruns unpaged
    always); unpaged if that paged rerun overflows. The rerun
    restores the random state of the attempt (CPU, CUDA, Megatron's tracker) so it draws the
    same dropout masks, and the router buffers the attempt's ``finalize_model_grads`` updated
    (the expert bias), so it routes as the attempt did: bitwise equal to the unpaged control;
    the MoE metrics logged for the step are the rerun's alone.
  - 'skip' / 'grow' drop a step whose flags are set (on any rank): parameters and optimizer
    state stay as they were; 'grow' then enlarges every pool's device tier. With fused torch
    optimizers nothing is read during the step (they take the flag as ``found_inf``; the flags
    are read when the next step starts, or by :meth:`PagedStashRunner.finish`); with any other
    optimizer the flags are read right after forward-backward and a dropped step's
    ``optimizer.step()`` is not called (a device-side drop would keep a copy of every stepped
    tensor: an overflowing step would need more memory than a pool large enough). Megatron's
    own ``update_successful`` reports True for such a step: count skips from
    ``monitor.skipped_steps``.

* Full-iteration CUDA graphs (:mod:`.graphs`): a replayed step's flags are read after the
  replay, outside the graph; a rerun runs the graph's schedule function eagerly; pools that grow
  (a 'rerun' or 'grow' on a rank that fell short) drop the graph, which Megatron-Core
  re-captures after its warm-up steps.

The dispatchers' sticky over-budget flags are cleared once a step's flags are packed, so one
over-budget step drops only itself. Evaluations (``forward_only``) are no training steps: see
:meth:`PagedStashRunner.__call__`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe import paged_stash as mcore_paged_stash
from megatron.core.utils import get_attr_wrapped_model, log_single_rank

from megatron_paging.mcore import graphs
from megatron_paging.mcore.flag_checks import check_megatron_combinations
from megatron_paging.mcore.step_state import (
    StepState,
    rng_state,
    set_rng_state,
    step_updated_buffers,
)
from megatron_paging.overflow.monitor import OverflowMonitor
from megatron_paging.overflow.policy import RerunPolicy, StepFlags

logger = logging.getLogger(__name__)


def _moe_layers(model) -> list:
    """Every MoE MLP whose dispatcher reports an over-budget flag (as Megatron-Core collects)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    layers = []
    for chunk in model:
        root = get_attr_wrapped_model(chunk, "decoder", allow_none=False, return_model_obj=True)
        blocks = list(root.decoder.layers)
        if getattr(root, "mtp_process", False):
            blocks += list(root.mtp.layers)
        for layer in blocks:
            if isinstance(layer, MultiTokenPredictionLayer):
                layer = layer.mtp_model_layer
            mlp = getattr(layer, "mlp", None)
            if hasattr(getattr(mlp, "token_dispatcher", None), "check_over_budget"):
                layers.append(mlp)
    return layers


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained, mixed precision, fp32)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", None)
        if isinstance(torch_optimizer, torch.optim.Optimizer):
            found.append(torch_optimizer)
    return found


class _ApiFlags:
    """Paging flags read through Megatron-Core's module functions (whatever backs them)."""

    def __init__(self, overflow: torch.Tensor, host_spill: torch.Tensor):
        self.device = overflow.device
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.values = torch.cat(
            [overflow.reshape(1).to(torch.int64), host_spill.reshape(1).to(torch.int64), zero]
        )


@dataclass
class _Attempt:
    """One call's data and random state: what a rerun repeats."""

    kwargs: dict
    saved_batches: list  # per chunk: its microbatches (None: no data on this chunk)
    rng_before: dict
    training: bool
    result: object = None
    state_before: StepState | None = None  # restored before a rerun


class PagedStashRunner:
    """Forward-backward wrapper with deferred overflow handling (see the module docstring).

    Args (Megatron-Core's): config, copy_main_params, model, optimizer, forward_backward_func.
    Keyword-only:
        paging: the paging API (:class:`megatron_paging.mcore.api.MCorePagingAPI`); its engine
            gives the flags, the pools ('grow') and the config's ``overflow_policy``, and its
            ``paged_stash_reset`` turns paging off for a rerun. None: read flags through
            Megatron-Core's module functions and use the 'rerun' policy.
        group: process group of the flag all_reduce (default: world).
    """

    def __init__(
        self,
        config,
        copy_main_params,
        model,
        optimizer,
        forward_backward_func,
        *,
        paging=None,
        group=None,
    ):
        self.config = config
        self.copy_main_params = copy_main_params
        self.model = model
        self.optimizer = optimizer
        self.forward_backward_func = forward_backward_func
        self.paging = paging
        self.moe_layers = _moe_layers(model)
        self.updated_buffers = step_updated_buffers(model)  # restored before a rerun
        self._configs = {id(config): config}
        for chunk in model:
            root = get_attr_wrapped_model(chunk, "decoder", allow_none=False, return_model_obj=True)
            self._configs.setdefault(id(root.config), root.config)
        if paging is not None and getattr(config, "moe_paged_stash", False):
            # The model's config is the line as Megatron runs it, the flags it rewrote from
            # others included (--enable-cuda-graph, --moe-layer-recompute, ...): what the
            # start-up checks refuse is refused here too, before the first step, whatever the
            # driver.
            check_megatron_combinations(config)
        self.eval_reruns = 0  # evaluations rerun without paging / static budget
        self.recalibrations = 0  # pools dropped because a step ran more microbatches
        self._microbatches: int | None = None  # per training step, as last run
        self.graph_invalidations = 0  # captured graphs dropped by 'grow'
        engine = getattr(paging, "engine", None)
        self.monitor = OverflowMonitor(
            engine.config.overflow_policy if engine is not None else RerunPolicy(),
            grow=self.grow_pools, optimizers=_torch_optimizers(optimizer), group=group,
            # the engine's page demand names the flag to set when a step overflows
            demand=engine if hasattr(engine, "demand_values") else None,
        )
        if self.monitor.steps_made_device_resident:
            log_single_rank(
                logger,
                logging.INFO,
                "paging: switched torch Adam to capturable=True so step counters live on "
                "the device (needed for the device-side optimizer skip; use the same "
                "setting in control runs)",
            )

    # -- flags -------------------------------------------------------------------------------
    def _flag_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _paging_flags(self):
        engine = getattr(self.paging, "engine", None)
        flags = getattr(engine, "flags", None)
        if flags is not None:
            return flags
        if self.paging is not None:
            return _ApiFlags(
                self.paging.check_paged_stash_overflow(),
                self.paging.check_paged_stash_host_spill(),
            )
        return _ApiFlags(
            mcore_paged_stash.check_paged_stash_overflow(),
            mcore_paged_stash.check_paged_stash_host_spill(),
        )

    def _reduce_flags(self) -> torch.Tensor:
        """The step's packed flags, reduced over ranks; the dispatchers' sticky over-budget
        flags are cleared once packed, so the next step starts clean under every policy."""
        over_budget = [mlp.token_dispatcher.check_over_budget() for mlp in self.moe_layers]
        reduced = self.monitor.reduce(self._paging_flags(), over_budget, self._flag_device())
        for mlp in self.moe_layers:
            reset = getattr(mlp.token_dispatcher, "reset_over_budget", None)
            if reset is not None:
                reset()
        return reduced

    def grow_pools(self, factor: float) -> bool:
        """Larger device tiers for the next step or a paged rerun; a captured graph is dropped
        when they change. False when there are no pools of ours (Megatron-Core's manager)."""
        engine = getattr(self.paging, "engine", None)
        if engine is None or engine.pools is None:
            log_single_rank(logger, logging.INFO, "paging: no pools of ours to grow")
            return False
        before = (engine.pools, getattr(engine, "offload_pools", None))
        engine.grow(factor)
        after = (engine.pools, getattr(engine, "offload_pools", None))
        changed = any(new is not old for new, old in zip(after, before, strict=True))
        if changed and graphs.invalidate(self.forward_backward_func, training=True):
            self.graph_invalidations += 1
            log_single_rank(
                logger,
                logging.INFO,
                "paging: pools grew, so the captured CUDA graph was dropped; Megatron-Core "
                "captures it again after its warm-up steps",
            )
        return True

    def finish(self) -> None:
        """Read and act on the last step's flags now (end of training, before checkpoints)."""
        self.monitor.settle()

    # -- Megatron-Core's interface ------------------------------------------------------------
    def data_read(self, data_iterator, model, training, num_microbatches):
        """Buffer every microbatch so a rerun (or two) sees the same data (as Megatron-Core
        does): the microbatches per chunk, and iterators over them for this attempt."""
        del training
        chunks = len(model) if isinstance(model, list) else 1
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) != chunks and not (chunks == 1 and len(iterators) == 1):
            raise ValueError(
                f"data_iterator has {len(iterators)} entries for {chunks} model chunk(s)"
            )
        saved, fresh = [], []
        for iterator in iterators:
            if iterator is None:
                saved.append(None)
                fresh.append(None)
                continue
            batches = [next(iterator) for _ in range(num_microbatches)]
            saved.append(batches)
            fresh.append(iter(batches))
        return saved, fresh

    def _set_moe_paged_stash(self, value: bool) -> None:
        for config in self._configs.values():
            config.moe_paged_stash = value

    def _set_static_budget(self, restore: bool) -> None:
        for mlp in self.moe_layers:
            manager = getattr(mlp.token_dispatcher, "_comm_manager", None)
            if hasattr(manager, "moe_expert_rank_capacity_factor"):
                manager.moe_expert_rank_capacity_factor = (
                    mlp.token_dispatcher.config.moe_expert_rank_capacity_factor if restore else None
                )
                if not restore:
                    mlp.token_dispatcher.reset_over_budget()

    def prepare_for_rerun(self, is_training: bool = True, keep_static_budget: bool = False,
                          paged: bool = False) -> None:
        """Paging off (unless ``paged``: the rerun goes through the pools as they are now), the
        static dispatch budget off (unless ``keep_static_budget``), flags cleared and, for
        training, grads cleared (Megatron-Core's; it also clears grads before an evaluation
        rerun). The rerun runs eagerly, beside any captured graph."""
        if not keep_static_budget:
            self._set_static_budget(restore=False)
        if not paged:
            if self.paging is not None:
                self.paging.paged_stash_reset(enabled=False, config=self.config)
            self._set_moe_paged_stash(False)
        if is_training:  # an evaluation produced no gradients and must not drop the step's
            for chunk in self.model:
                if hasattr(chunk, "zero_grad_buffer"):
                    chunk.zero_grad_buffer()
            if self.optimizer is not None:
                self.optimizer.zero_grad()
            if self.copy_main_params and self.optimizer is not None:
                chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
                for inner in chained:
                    if hasattr(inner, "shard_fp32_from_float16_groups"):
                        inner._copy_main_params_to_param_buffer()

    def __call__(self, *args, **kwargs):
        """Run forward-backward, then act on its flags (see the module docstring).

        Evaluation (``forward_only=True``) is not a training step: it is not counted by the
        monitor, leaves ``monitor.skip`` (the training step's optimizer flag) alone and ignores
        the policy. Its flags are read right away (an evaluation has no optimizer step to defer
        to) and, if the static dispatch budget dropped tokens (or paging failed), it is rerun
        once without paging and without the budget, so garbage losses never reach the caller;
        ``eval_reruns`` counts those reruns.
        """
        if args:
            raise TypeError("PagedStashRunner: forward_backward_func takes keyword arguments only")
        missing = [
            k
            for k in ("model", "data_iterator", "num_microbatches", "seq_length", "forward_only")
            if k not in kwargs
        ]
        if missing:
            raise TypeError(f"PagedStashRunner: missing keyword argument(s) {missing}")
        self.finish()  # deferred: the previous step's flags, before this step's data
        training = not kwargs["forward_only"]
        if training:
            self._note_microbatches(kwargs["num_microbatches"])
        saved_batches, kwargs["data_iterator"] = self.data_read(
            kwargs["data_iterator"], kwargs["model"], training, kwargs["num_microbatches"]
        )
        attempt = _Attempt(kwargs, saved_batches, rng_state(), training,
                           state_before=StepState(self.updated_buffers))
        attempt.result = self.forward_backward_func(**kwargs)
        if self.paging is not None and graphs.replayed(self.forward_backward_func, training):
            graphs.note_replay(self.paging)
        reduced = self._reduce_flags()
        rerun = functools.partial(self._rerun, attempt)
        if training:
            self.monitor.after_forward_backward(reduced, rerun)
        else:
            self._check_evaluation(reduced, rerun)
        return attempt.result

    def _note_microbatches(self, count: int) -> None:
        """A growing batch (``--step-batch-size-schedule``): a pipeline rank keeps min(count,
        its warm-up depth) microbatches alive, so pools calibrated while a step had fewer
        microbatches than the pipeline holds would overflow on every later step (and 'skip'
        would drop them all). Such pools are dropped and the step calibrates again; at PP = 1,
        or once the count is past the depth, the pools stay."""
        previous, self._microbatches = self._microbatches, count
        engine = getattr(self.paging, "engine", None)
        if previous is None or count <= previous or getattr(engine, "pools", None) is None:
            return
        pp = getattr(self.config, "pipeline_model_parallel_size", 1) or 1
        vpp = getattr(self.config, "virtual_pipeline_model_parallel_size", None) or 1
        if pp == 1 or previous >= pp * (vpp + 1):  # past every schedule's warm-up depth
            return
        engine.release_pools()
        graphs.invalidate(self.forward_backward_func, training=True)
        self.recalibrations += 1
        log_single_rank(
            logger, logging.INFO,
            f"paging: {previous} -> {count} microbatches per step (--step-batch-size-schedule) "
            "changes what a pipeline rank keeps alive; the pools calibrate again on this step",
        )

    def _check_evaluation(self, reduced: torch.Tensor, rerun) -> None:
        """An evaluation has no optimizer step to defer to: its flags are read now."""
        flags = self.monitor.read(reduced)
        if not flags.discard:
            return
        log_single_rank(
            logger,
            logging.INFO,
            "paging: evaluation dropped tokens or overflowed; rerunning it without paging"
            + (" and without the static dispatch budget" if flags.over_budget_ranks else ""),
        )
        self.eval_reruns += 1
        self.monitor.rerun(rerun, flags, training=False)

    def _rerun(self, attempt: _Attempt, flags: StepFlags, paged: bool = False) -> torch.Tensor:
        """Repeat forward-backward on the same data and random draws, eagerly: through the
        pools as they are now (``paged``, after 'rerun' grew them) or without paging; the
        static dispatch budget stays unless a dispatcher was over it (``flags``). Returns the
        rerun's reduced flags."""
        saved_paged_stash = self.config.moe_paged_stash
        self.prepare_for_rerun(
            is_training=attempt.training, keep_static_budget=not flags.over_budget_ranks,
            paged=paged,
        )
        set_rng_state(attempt.rng_before)
        attempt.state_before.restore()
        data = [None if batches is None else iter(batches) for batches in attempt.saved_batches]
        kwargs = dict(attempt.kwargs, data_iterator=data)
        try:
            attempt.result = graphs.eager_function(self.forward_backward_func)(**kwargs)
            return self._reduce_flags()
        finally:
            self._set_moe_paged_stash(saved_paged_stash)
            self._set_static_budget(restore=True)


__all__ = ["PagedStashRunner"]
