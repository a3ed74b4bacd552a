"""Megatron-Core's fine-grained activation offloading, served by the paging runtime.

* :mod:`.backend` — ``--paging-offload-backend paged``: Megatron-Core's offloading interface
  onto the runtime's scheduler (expert inputs move their live rows, dense tensors move whole).
* :mod:`.groups` — which offload groups a step offloads (Megatron-Core's knobs, decided once).
* :mod:`.shims` — the few Megatron-Core checks lifted where their reason does not hold.
"""
