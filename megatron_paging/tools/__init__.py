"""Simulators and diagnostics outside the paging runtime (the runtime never imports them).

* :mod:`.pipeline_sim` — one pipeline rank's schedule run in one process over a synthetic MoE
  layer stack, for tests and the scheduler benchmark.
* :mod:`.memory_trace` — what is allocated at a step's memory peak, from an allocator trace.
* :mod:`.kernel_timeline` — where a profiled step's device time goes, and what differs between
  two profiled steps (paging kernels not hidden, compute kernels slowed beside them).
"""
