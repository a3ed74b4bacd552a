"""Everything that knows Megatron-Core (the only package here that imports megatron). It only
translates Megatron-Core to the runtime (:mod:`megatron_paging.runtime.engine`,
:mod:`megatron_paging.runtime.context`) and, for ``megatron-paging plan``, a launch line to the
plan's inputs.

Entry point: ``megatron_paging.mcore.install()`` (call it before building a model), undone by
``megatron_paging.mcore.uninstall()``. Modules: ``installer`` (rebinding), ``api`` (Megatron-Core's
paged-stash API onto the runtime), ``flags`` and ``flag_checks`` (command line -> ``PagingConfig``,
one-line refusals), ``graphs`` (full-iteration CUDA graphs), ``dispatcher`` (the ``static``
sync-free dispatch backend), ``experts`` and ``expert_activation`` (TE-free paged grouped
experts), ``attention`` (TE-free core attention), ``specs`` (GPT-MoE block spec), ``runner``
(Megatron-Core's ``PagedStashRunner``) with ``step_state`` (what its rerun restores),
``validation`` (Megatron's argument and config checks before start-up), ``plan_inputs`` and
``plan_cli`` (a launch line -> :mod:`megatron_paging.plan`; the command), ``op_order`` (one
rank's compute-op order from Megatron-Core's schedule generators), ``offloading/``
(Megatron-Core's activation offloading onto the runtime), ``ddp_stream`` (DDP's accumulators on
the training stream), ``peers`` (emulated EP/PP peers under ``--fake-process-group``). See
docs/mcore.md.
"""

from megatron_paging.mcore.installer import install, uninstall

__all__ = ["install", "uninstall"]
