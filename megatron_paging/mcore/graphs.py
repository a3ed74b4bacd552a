"""What Megatron-Core's full-iteration CUDA graphs mean for paging, in one place.

``--cuda-graph-impl full_iteration`` wraps the schedule function in Megatron-Core's
``FullCudaGraphWrapper``: ``cuda_graph_warmup_steps`` eager calls, then one capture on
Megatron-Core's shared capture stream (with its graph memory pool, ``thread_local`` capture
mode, ``set_override_stale_capture_stream`` and every RNG generator registered), then replays.
Paging fits it as follows (docs/mcore.md, "CUDA graphs"):

* calibration is the first eager warm-up step; its ``end_step`` sizes the pools and makes the
  kernels' pool handles, so the captured steps allocate nothing of ours and read nothing on
  the host (the engine refuses a capture that would calibrate);
* the captured region holds the engine's ``begin_step`` (ring and flag reset) and ``end_step``
  (the paging stream joined into the capture stream, :class:`FinishingForwardBackward`); every
  stash and reload forks from and joins back into the capture stream through events recorded
  inside it; reload destinations come from the graph's pool;
* Python runs only while capturing: on a replay no hook runs, so the runner asks
  :func:`replayed` and then reads the pools' flags that the replay set (:func:`note_replay`);
* a rerun repeats the step eagerly through the graph's own schedule function
  (:func:`eager_function`), keeping the graph; ``grow`` changes pool addresses, so it drops the
  graph (:func:`invalidate`) and Megatron-Core re-captures after its warm-up steps, into a new
  graph memory pool (tensors of the dropped capture may still be alive in the old one, and the
  caching allocator refuses to capture into a released pool that still holds blocks).
"""

from __future__ import annotations

import torch
from megatron.core import full_cuda_graph
from megatron.core.full_cuda_graph import FullCudaGraphWrapper


def _stage(training: bool) -> str:
    return "training" if training else "validation"


def graph_wrapper(forward_backward_func) -> FullCudaGraphWrapper | None:
    if isinstance(forward_backward_func, FullCudaGraphWrapper):
        return forward_backward_func
    return None


def replayed(forward_backward_func, training: bool) -> bool:
    """Whether the call that just returned ran as a graph replay (capture calls replay too)."""
    wrapper = graph_wrapper(forward_backward_func)
    return wrapper is not None and FullCudaGraphWrapper.cuda_graph[_stage(training)] is not None


def eager_function(forward_backward_func):
    """What a rerun calls: the graph's schedule function itself (no capture, no replay)."""
    wrapper = graph_wrapper(forward_backward_func)
    return forward_backward_func if wrapper is None else wrapper.forward_backward_func


def invalidate(forward_backward_func, training: bool = True) -> bool:
    """Drop the captured graph (its pool addresses changed); True if there was one to drop.

    Before a capture nothing is dropped: the warm-up count goes on and the capture will see the
    new pools."""
    wrapper = graph_wrapper(forward_backward_func)
    if wrapper is None or FullCudaGraphWrapper.cuda_graph[_stage(training)] is None:
        return False
    wrapper.reset_cuda_graph(stage=_stage(training))
    # Megatron-Core hands every capture one shared pool (--cuda-graph-use-single-mempool, on by
    # default). The dropped graph released it, but its outputs (the step's result, reloads a
    # later step has not freed yet) can keep blocks there, and capturing into a released pool
    # with live blocks trips the allocator's use_count assert; the old pool is freed with its
    # last block.
    if full_cuda_graph._shared_graph_pool is not None:
        full_cuda_graph._shared_graph_pool = torch.cuda.graph_pool_handle()
    return True


def note_replay(api) -> None:
    """A replay ran the captured paged step: its pools' flags are this step's."""
    api.engine.note_replayed_step()


__all__ = ["eager_function", "graph_wrapper", "invalidate", "note_replay", "replayed"]
