"""What a step that ran out of pages does, and what it needed.

* :mod:`.demand` — the page demand a step's stashes count on the device beside each copy, and
  the overflow report built from it (where it began, rows needed and held, the flag to set).
* :mod:`.policy` — :class:`~.policy.OverflowPolicy` ('rerun', 'skip', 'grow'): the one type the
  config holds for ``--paging-overflow-policy``.
* :mod:`.monitor` — :class:`~.monitor.OverflowMonitor`: around each of a driver's steps, one
  flag reduction, one host read, the policy's decision.
* :mod:`.optimizer_skip` — a discarded step's optimizer update dropped on the device.

The lowest layer: it imports nothing else of the package. Pools count into it, the config names
its policies, the engine answers its demand questions, drivers run its monitor.
"""
