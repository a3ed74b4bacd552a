"""The training-step runner that replaces Megatron-Core 0.19.2's ``PagedStashRunner``.

Same constructor and call signature as ``megatron.core.transformer.moe.paged_stash
.PagedStashRunner``; ``install()`` rebinds ``megatron.training.training.PagedStashRunner`` to
this class (bound to the paging API through the ``paging`` keyword). What changes:

* One collective per step: paging overflow, host spill, invalid live counts and the dispatchers'
  over-budget flags are packed in one tensor and all-reduced together, with no host read.
* Device-side optimizer skip ('skip' and 'grow' only): every inner torch optimizer's ``step``
  goes through :func:`megatron_paging.overflow.step_unless`, so a step whose flags are set (on
  any rank) leaves parameters and optimizer state untouched without the host looking at the
  flag. It sits under Megatron-Core's own skip (``found_inf`` + loss scaler of its
  mixed-precision optimizers, which still works as before) and covers bf16 runs that have no
  grad scaler. Unless the optimizer is fused it keeps a copy of the stepped parameters and
  state during the step (memory); 'rerun' leaves the optimizer untouched.
* A rerun restores the random state (CPU, CUDA, Megatron's RNG tracker) of the attempt it
  replaces, so it draws the same dropout masks.
* Policies (``config.moe_paging_overflow_policy``, default 'rerun'):

  - 'rerun' (Megatron-Core's behaviour): flags are read right after forward-backward and the
    step is repeated once without paging, before the optimizer consumes the gradients. One host
    read per step, as in Megatron-Core. Unlike Megatron-Core, the static dispatch budget is
    dropped for the rerun only when a dispatcher was over budget: a step that only overflowed
    the pools reruns at the same capacity, so it is bitwise equal to the unpaged control.
  - 'skip' / 'grow': nothing is read during the step. The reduced flags are read when the next
    step starts (or by :meth:`PagedStashRunner.finish`); the step was already dropped on
    device; 'grow' then enlarges every pool's CUDA tier by ``growth_factor``. Megatron's own
    ``update_successful`` reports True for such a step: count skips from ``skipped_steps``.

  The dispatchers' sticky over-budget flags are cleared once a step's flags are packed, so one
  over-budget step drops only itself. Evaluations (``forward_only``) are no training steps:
  see :meth:`PagedStashRunner.__call__`.

Nothing here runs inside a CUDA-graph-captured region: the runner wraps the (possibly
graph-captured) forward-backward callable and the optimizer step from the outside.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.moe import paged_stash as mcore_paged_stash
from megatron.core.utils import get_attr_wrapped_model, log_single_rank

from megatron_paging.overflow import (
    DeviceSkip,
    OverflowMonitor,
    device_resident_steps,
    grow_pools,
    skip_flag,
)

logger = logging.getLogger(__name__)


def rng_state() -> dict:
    """Every generator a forward-backward draws from (dropout): CPU, CUDA, Megatron's tracker.
    Host-side state only (seed and offset): no device synchronization."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


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


class PagedStashRunner:
    """Forward-backward wrapper with deferred overflow handling (see the module docstring).

    Args (Megatron-Core's): config, copy_main_params, model, optimizer, forward_backward_func.
    Keyword-only:
        paging: the paging API (:class:`megatron_paging.mcore.api.MCorePagingAPI`); used for
            ``engine.pools`` (flags incl. invalid live counts, 'grow') and
            ``paged_stash_reset``. None: read flags through Megatron-Core's module functions.
        policy: 'rerun', 'skip' or 'grow' (default: ``config.moe_paging_overflow_policy`` or
            'rerun').
        growth_factor: CUDA tier multiplier of 'grow'.
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
        policy: str | None = None,
        growth_factor: float = 1.5,
        group=None,
    ):
        self.config = config
        self.copy_main_params = copy_main_params
        self.model = model
        self.optimizer = optimizer
        self.forward_backward_func = forward_backward_func
        self.paging = paging
        if policy is None:
            policy = getattr(config, "moe_paging_overflow_policy", None) or "rerun"
        self.monitor = OverflowMonitor(policy, group=group, growth_factor=growth_factor)
        self.moe_layers = _moe_layers(model)
        self._configs = {id(config): config}
        for chunk in model:
            root = get_attr_wrapped_model(chunk, "decoder", allow_none=False, return_model_obj=True)
            self._configs.setdefault(id(root.config), root.config)
        self.skip: torch.Tensor | None = None  # the current step's device skip flag
        self._pending: torch.Tensor | None = None  # reduced flags awaiting the deferred read
        self.eval_reruns = 0  # evaluations rerun without paging / static budget
        self.device_skips = []
        # 'rerun' reads the flags before the optimizer step and repairs the step, so the
        # optimizer is left exactly as Megatron built it (the device skip would cost a copy of
        # the parameters and optimizer state at every step for non-fused optimizers).
        optimizers = _torch_optimizers(optimizer) if self.monitor.policy != "rerun" else []
        for torch_optimizer in optimizers:
            if device_resident_steps(torch_optimizer):
                log_single_rank(
                    logger,
                    logging.INFO,
                    "paging: switched torch Adam to capturable=True so step counters live on "
                    "the device (needed for the device-side optimizer skip; use the same "
                    "setting in control runs)",
                )
            self.device_skips.append(DeviceSkip(torch_optimizer, lambda: self.skip))

    @property
    def skipped_steps(self) -> int:
        return self.monitor.skipped_steps

    # -- flags -------------------------------------------------------------------------------
    def _flag_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _paging_flags(self):
        engine = getattr(self.paging, "engine", None)
        pools = getattr(engine, "pools", None)
        if pools is not None and getattr(self.paging, "enabled", True):
            return pools.flags
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

    def finish(self) -> None:
        """Read and act on the last step's flags now (end of training, before checkpoints)."""
        if self._pending is None:
            return
        reduced, self._pending = self._pending, None
        decision = self.monitor.decide(self.monitor.read(reduced))
        if decision.action == "grow":
            engine = self.paging.engine if self.paging is not None else None
            if engine is None or engine.pools is None:
                log_single_rank(logger, logging.INFO, "paging: 'grow' found no pools to grow")
            else:
                engine.pools = grow_pools(engine.pools, self.monitor.growth_factor)

    # -- Megatron-Core's interface ------------------------------------------------------------
    def data_read(self, data_iterator, model, training, num_microbatches):
        """Buffer every microbatch so a rerun sees the same data (as Megatron-Core does)."""
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
            saved.append(iter(batches))
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

    def prepare_for_rerun(self, is_training: bool = True, keep_static_budget: bool = False) -> None:
        """Paging off, the static dispatch budget off (unless ``keep_static_budget``), flags
        cleared and, for training, grads cleared (Megatron-Core's; it also clears grads before
        an evaluation rerun)."""
        if not keep_static_budget:
            self._set_static_budget(restore=False)
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
        reset_graph = getattr(self.forward_backward_func, "reset_cuda_graph", None)
        if reset_graph is not None:
            reset_graph(stage="training" if is_training else "validation")

    def __call__(self, *args, **kwargs):
        """Run forward-backward, then act on its flags (see the module docstring).

        Evaluation (``forward_only=True``) is not a training step: it is not counted by the
        monitor, leaves ``self.skip`` (the training step's optimizer flag) alone and ignores
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
        saved_iterators, kwargs["data_iterator"] = self.data_read(
            kwargs["data_iterator"], kwargs["model"], training, kwargs["num_microbatches"]
        )
        rng_before = rng_state()  # a rerun draws the same dropout masks as its attempt
        result = self.forward_backward_func(**kwargs)
        reduced = self._reduce_flags()
        if not training:
            flags = self.monitor.read(reduced)
            if flags.discard:
                log_single_rank(
                    logger,
                    logging.INFO,
                    "paging: evaluation dropped tokens or overflowed; rerunning it without "
                    "paging"
                    + (
                        " and without the static dispatch budget" if flags.over_budget_ranks else ""
                    ),
                )
                self.eval_reruns += 1
                result = self._rerun(
                    kwargs,
                    saved_iterators,
                    rng_before,
                    training=False,
                    keep_static_budget=not flags.over_budget_ranks,
                )
            return result

        self.skip = skip_flag(reduced)
        if self.monitor.policy != "rerun":
            self._pending = reduced
            return result
        # 'rerun': read now, before the optimizer consumes the gradients.
        flags = self.monitor.read(reduced)
        decision = self.monitor.decide(flags)
        if decision.action == "rerun":
            result = self._rerun(
                kwargs,
                saved_iterators,
                rng_before,
                training=True,
                keep_static_budget=not flags.over_budget_ranks,
            )
        return result

    def _rerun(self, kwargs, saved_iterators, rng_before, training: bool, keep_static_budget=False):
        """Repeat forward-backward on the same data and random draws without paging (and,
        unless ``keep_static_budget``, without the static dispatch budget)."""
        saved_paged_stash = self.config.moe_paged_stash
        self.prepare_for_rerun(is_training=training, keep_static_budget=keep_static_budget)
        set_rng_state(rng_before)
        kwargs["data_iterator"] = saved_iterators
        try:
            result = self.forward_backward_func(**kwargs)
            rerun_flags = self._reduce_flags()
            if training:
                self.skip = skip_flag(rerun_flags)
            if self.monitor.read(rerun_flags).discard:
                raise RuntimeError(
                    "PagedStashRunner: the rerun without paging"
                    + ("" if keep_static_budget else " and without the static dispatch budget")
                    + " still raised an overflow flag"
                )
        finally:
            self._set_moe_paged_stash(saved_paged_stash)
            self._set_static_budget(restore=True)
        return result


__all__ = ["PagedStashRunner"]
