"""The paging runtime: one step life cycle, one saved-tensor hook, one paging stream per device.

* :mod:`.engine` — :class:`~.engine.PagingEngine`, a step's life cycle (calibrate, size, reset,
  finish); :mod:`.calibration` parks the first step's records and sizes the pools.
* :mod:`.context` — :class:`~.context.PagingContext`, the one saved-tensor hook; :mod:`.saved`
  (what it keeps for a saved tensor) and :mod:`.wgrad` (weight gradients deferred to a W op).
* :mod:`.scheduler` — :class:`~.scheduler.PagingScheduler`, when each record is stashed and
  reloaded (FIFO per slot); :mod:`.slot_queues` (its slots), :mod:`.transfers` (where a record's
  bytes go), :mod:`.sources` (how long a copy's source lives), :mod:`.streams` (CUDA or CPU).
* :mod:`.pipeline_ops` — one pipeline rank's compute ops (F, B, W) and the driver that runs them.

Model-agnostic: Megatron-Core's adapter, the demo and the benchmarks drive the same runtime.
"""
