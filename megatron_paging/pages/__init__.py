"""Where paged bytes live: page pools, the records of what a stash moved, host storage.

* :mod:`.pool` — :class:`~.pool.PagePool`: pages of one row size in a device tier and a pinned
  host tier, ring freelists and sticky flags on the device; :class:`~.pool.PagePools` keys a
  context's pools by row bytes.
* :mod:`.record` — :class:`~.record.PageRecord`: one buffer's segments, live counts and pages.
* :mod:`.offload` — the host-only pools and the pinned arena that offloaded records go to.

Storage only: the kernels (:mod:`megatron_paging.kernels`) move the bytes, the runtime decides
when.
"""
