"""Simulators and diagnostics outside the paging runtime: ``pages/``, ``runtime/``,
``overflow/`` and ``kernels/`` never import them; a run reaches them only through the demo, the
planner, or ``mcore/peers.py`` under ``--fake-process-group``.

* :mod:`.pipeline_sim` — one pipeline rank's schedule run in one process over a synthetic MoE
  layer stack, for tests and the scheduler benchmark.
* :mod:`.peer_load` — what emulated expert-parallel peers send one rank (a router-load model or
  a recorded trace), for the emulated peers and the planner.
* :mod:`.memory_trace` — what is allocated at a step's memory peak, from an allocator trace.
* :mod:`.kernel_timeline` — where a profiled step's device time goes, and what differs between
  two profiled steps (paging kernels not hidden, compute kernels slowed beside them).
"""
