"""The end-to-end demo: one pipeline rank of TinyMoE, unpaged control vs paged, bitwise parity.

* :mod:`.model` — TinyMoE, a sync-free MoE with static expert capacity buffers, and its
  pipeline stage chunks.
* :mod:`.layout` — the rank's op order (real schedule generators) and stages.
* :mod:`.training` — the control and paged runs, through the pipeline simulator
  (:mod:`megatron_paging.tools.pipeline_sim`) and the overflow monitor
  (:mod:`megatron_paging.overflow.monitor`); :mod:`.accounting` counts the bytes they hold.
* :mod:`.verdict`, :mod:`.report` — the parity line, the table and the plot.
* :mod:`.cli` — ``megatron-paging demo``.
"""

from megatron_paging.demo.model import StageChunk, TinyMoE, TinyMoEConfig

__all__ = ["StageChunk", "TinyMoE", "TinyMoEConfig"]
