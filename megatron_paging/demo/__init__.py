"""The end-to-end demo: one pipeline rank of TinyMoE, unpaged control vs paged, bitwise parity.

* :mod:`.model` — TinyMoE, a sync-free MoE with static expert capacity buffers.
* :mod:`.pipeline` — TinyMoE split into pipeline stage chunks, run through a ``PagingContext``
  along a real schedule order.
* :mod:`.training` — the control and paged training loops (calibration, overflow policies).
* :mod:`.cli` — ``megatron-paging demo``.
"""

from megatron_paging.demo.model import TinyMoE, TinyMoEConfig
from megatron_paging.demo.pipeline import StageChunk, run_step

__all__ = ["StageChunk", "TinyMoE", "TinyMoEConfig", "run_step"]
