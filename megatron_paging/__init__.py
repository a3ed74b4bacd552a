"""megatron-paging: paged MoE activation stashing for Megatron-Core.

Core pieces (no Megatron import): :mod:`.pool` (pages and rings), :mod:`.record` (what a stash
moved), :mod:`.kernels` (stash / reload), :mod:`.scheduler` (when and on which stream).
Everything that knows Megatron-Core lives in :mod:`megatron_paging.mcore`.
"""

from megatron_paging.pages.pool import PagePool, PagePools, PagingFlags
from megatron_paging.pages.record import PageRecord
from megatron_paging.version import SUPPORTED_MEGATRON_CORE, __version__

__all__ = [
    "PagePool",
    "PagePools",
    "PageRecord",
    "PagingFlags",
    "SUPPORTED_MEGATRON_CORE",
    "__version__",
]
