"""Everything that knows Megatron-Core (the only package here that imports megatron). It only
translates Megatron-Core to the runtime (:mod:`megatron_paging.engine`,
:mod:`megatron_paging.paging`).

Entry point: ``megatron_paging.mcore.install()`` (call it before building a model), undone by
``megatron_paging.mcore.uninstall()``. Modules: ``installer`` (rebinding), ``api`` (Megatron-Core's
paged-stash API onto the runtime), ``flags`` (command line -> ``PagingConfig``), ``graphs``
(full-iteration CUDA graphs), ``dispatcher`` (the ``static`` sync-free dispatch backend),
``experts`` (TE-free paged grouped experts), ``attention`` (TE-free fused core attention),
``specs`` (GPT-MoE layer spec), ``runner`` (step runner), ``schedules`` (Megatron-Core's schedule
orders as ops). See docs/mcore.md.
"""

from megatron_paging.mcore.installer import install, uninstall

__all__ = ["install", "uninstall"]
