"""megatron-paging: paged MoE activation stashing for Megatron-Core.

Folders by role, each importing only those before it (docs/design.md, "Package map"):

* :mod:`.overflow` — what a step that ran out of pages does (demand, policy, monitor);
* :mod:`.config` — the flags and the runtime's validated config;
* :mod:`.pages` — where paged bytes live (pools, records, host storage);
* :mod:`.kernels` — stash and reload;
* :mod:`.runtime` — the step life cycle, the saved-tensor hook, the paging-stream scheduler;
* :mod:`.tools` — simulators and diagnostics off the runtime path;
* :mod:`.mcore` — everything that knows Megatron-Core (the only importer of megatron);
* :mod:`.demo`, :mod:`.plan`, :mod:`.cli` — the ``megatron-paging`` commands.
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
