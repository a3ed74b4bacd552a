"""The end-to-end demo: TinyMoE trained unpaged and paged, with a bitwise parity check.

* :mod:`.model` — TinyMoE, a sync-free MoE with static expert capacity buffers.
* :mod:`.hooks` — ``SavedTensorPaging``, saved-tensor hooks that page marked capacity buffers.
* :mod:`.cli` — ``megatron-paging demo``.
"""

from megatron_paging.demo.hooks import SavedTensorPaging
from megatron_paging.demo.model import TinyMoE, TinyMoEConfig

__all__ = ["SavedTensorPaging", "TinyMoE", "TinyMoEConfig"]
