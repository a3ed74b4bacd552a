"""Everything that knows Megatron-Core (the only package here that imports megatron).

Entry point: :func:`megatron_paging.mcore.install.install` (call it before building a model).
Modules: ``install`` (rebinding), ``api`` (Megatron-Core's paged-stash API, ours), ``engine``
(API events -> :class:`~megatron_paging.scheduler.PagingScheduler`), ``flags`` (command line),
``dispatcher`` (the ``static`` sync-free dispatch backend), ``experts`` (TE-free paged grouped
experts), ``specs`` (GPT-MoE layer spec), ``runner`` (step runner), ``schedules`` (schedule
orders for tests). See docs/mcore.md.
"""
